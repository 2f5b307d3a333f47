"""What ``tide up`` says it starts: only the parts the options and this machine allow."""
import shutil

from tide.stack import Stack, StackOptions


def test_parts_leave_out_external_services_and_a_disabled_prometheus(tmp_path):
    local = Stack(StackOptions(tmp_path, prometheus=False))
    assert local.parts == ["broker", "MLflow", "engine", "ingest", "scheduler"]
    external = Stack(StackOptions(tmp_path, bootstrap_servers="kafka:9092", tracking_uri="http://mlflow:5000",
                                  prometheus=False))
    assert external.parts == ["engine", "ingest", "scheduler"]


def test_parts_name_prometheus_only_when_its_binary_is_installed(tmp_path):
    parts = Stack(StackOptions(tmp_path)).parts
    assert ("Prometheus" in parts) == (shutil.which("prometheus") is not None)
