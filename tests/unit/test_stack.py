"""What ``tide up`` says it starts: only the parts the options and this machine allow; the ports
it picks: the asked or default one, or a free one when another process holds it."""
import shutil
import socket

import yaml

from tide.config import load_config
from tide.process import port_or_free
from tide.stack import DEFAULT_PORTS, Stack, StackOptions


def test_parts_leave_out_external_services_and_a_disabled_prometheus(tmp_path):
    local = Stack(StackOptions(tmp_path, prometheus=False))
    assert local.parts == ["broker", "MLflow", "engine", "ingest", "scheduler", "page"]
    external = Stack(StackOptions(tmp_path, bootstrap_servers="kafka:9092", tracking_uri="http://mlflow:5000",
                                  prometheus=False))
    assert external.parts == ["engine", "ingest", "scheduler", "page"]


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


def test_several_engines_run_behind_the_front_and_every_part_asks_the_alias_owner(tmp_path):
    stack = Stack(StackOptions(tmp_path, prometheus=False, engines=2))
    assert stack.parts == ["broker", "MLflow", "2 engines", "front", "ingest", "scheduler", "page"]
    path = tmp_path / "tide.yaml"
    path.write_text(yaml.safe_dump(stack._config("127.0.0.1:9999", "http://127.0.0.1:5000",
                                                 {"engine": 1, "ingest": 2, "scheduler": 3}, "t")))
    cfg = load_config(path, env={})
    # the scheduler's port serves the alias owner's API; the control token is its bearer token
    assert cfg.ops.alias_owner_url == "http://127.0.0.1:3" and cfg.schedule.metrics_port == 3
    assert cfg.server.control_token == "t" and not cfg.ops.alias_owner_token


def test_a_taken_port_falls_back_to_a_free_one_and_a_free_one_is_kept(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        fallback = port_or_free(taken)
        assert fallback != taken and fallback > 0
        with socket.socket() as probe:  # the fallback is bindable now
            probe.bind(("127.0.0.1", fallback))
        opts = StackOptions(tmp_path, ports={"page": taken})
        assert opts.port("page") != taken
    with socket.socket() as s:  # released: the asked port is kept
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert StackOptions(tmp_path, ports={"engine": free}).port("engine") == free


def test_default_ports_are_the_documented_ones():
    assert DEFAULT_PORTS == {"engine": 8000, "mlflow": 5000, "prometheus": 9090, "page": 8090}


def _exposures(write, path) -> list[str]:
    """Every moment ``write(path, text)`` lets a file holding the text be read by group or others,
    seen from Python's audit events (open, chmod, rename) on any path in ``path``'s folder."""
    import os
    import stat
    import sys

    seen: list[str] = []
    folder = str(path.parent)

    def hook(event, args):
        if not active or event not in ("open", "os.chmod", "os.rename"):
            return
        for arg in args:
            if isinstance(arg, (str, os.PathLike)) and str(arg).startswith(folder) and os.path.isfile(arg):
                st = os.stat(arg)
                if st.st_size and st.st_mode & 0o077:
                    seen.append(f"{event} {arg} {stat.filemode(st.st_mode)}")
    active = True
    sys.addaudithook(hook)  # hooks cannot be removed: ``active`` switches it off
    old = os.umask(0)  # the worst umask: nothing masked
    try:
        write(path, "server:\n  control_token: s3cret\n")
        write(path, "server:\n  control_token: rotated\n")  # over an existing file
    finally:
        os.umask(old)
        active = False
    return seen


def test_tide_yaml_is_owner_only_from_its_first_byte(tmp_path):
    from tide.stack import write_private

    path = tmp_path / "run" / "tide.yaml"
    assert _exposures(write_private, path) == []
    assert path.stat().st_mode & 0o777 == 0o600 and "rotated" in path.read_text()
    assert [p.name for p in path.parent.iterdir()] == ["tide.yaml"]  # no temporary left
    # the check sees the window a plain write-then-chmod leaves (the previous code)
    def naive(p, text):
        p.write_text(text)
        p.chmod(0o600)
    assert _exposures(naive, tmp_path / "naive.yaml")


def test_the_object_store_gets_an_s3_port_whose_grpc_port_exists(tmp_path, monkeypatch):
    """weed listens on its S3 port and on that port + 10000: a port above 55535 made it die at start-up."""
    import pytest

    from tide import broker

    asked = []

    def pick(*args, **kwargs):
        asked.append(kwargs)
        raise RuntimeError("picked")
    monkeypatch.setattr(broker, "free_port", pick)
    with pytest.raises(RuntimeError, match="picked"):
        Stack(StackOptions(tmp_path, prometheus=False))._start_store(tmp_path / "logs")
    assert asked == [{"grpc_offset": True}]
    with pytest.raises(broker.BrokerError, match="gRPC port"):  # a port given from outside is checked too
        broker.BrokerStack("store", 0, tmp_path, s3_port=60001).start_store(1.0)
