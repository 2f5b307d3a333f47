"""What ``tide up`` says it starts: only the parts the options and this machine allow."""
import shutil

import yaml

from tide.config import load_config
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


def test_stack_config_points_capture_and_ingest_at_one_kafka_section(tmp_path):
    stack = Stack(StackOptions(tmp_path, prometheus=False))
    path = tmp_path / "tide.yaml"
    path.write_text(yaml.safe_dump(stack._config("127.0.0.1:9999", "http://127.0.0.1:5000",
                                                 {"engine": 1, "ingest": 2, "scheduler": 3}, "t")))
    cfg = load_config(path, env={})  # loads: no key the config rejects
    assert cfg.kafka.bootstrap_servers == "127.0.0.1:9999" and cfg.capture.enabled
