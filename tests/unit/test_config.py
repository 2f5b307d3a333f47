"""Config loading: defaults, YAML, env overlay, unknown keys rejected, types coerced."""
import pytest

from tide.config import ConfigError, load_config
from tide.redact import config_as_dict


def test_defaults_need_no_file():
    cfg = load_config(env={})
    assert cfg.spec.draft_len >= 1 and cfg.model.torch_threads == 1


def test_yaml_then_env_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("spec:\n  draft_len: 3\nserver:\n  port: 9000\n")
    cfg = load_config(f, env={"TIDE_SERVER__PORT": "9100", "TIDE_SPEC__ENABLED": "false"},
                      overrides={"model": {"aux_layer_ids": "2,15,27"}})
    assert cfg.spec.draft_len == 3 and cfg.server.port == 9100 and cfg.spec.enabled is False
    assert cfg.model.aux_layer_ids == (2, 15, 27)


@pytest.mark.parametrize("text,match", [
    ("spec:\n  draft_lenn: 3\n", "unknown key"),
    ("nosuchsection:\n  a: 1\n", "unknown key"),
    ("spec:\n  draft_len: three\n", "draft_len"),
    ("spec: 3\n", "expected a mapping"),
    ("- a\n- b\n", "top level must be a mapping"),
])
def test_bad_config_is_a_clear_error(tmp_path, text, match):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(f, env={})


def test_bad_env_is_a_clear_error():
    with pytest.raises(ConfigError, match="TIDE_A__B__C"):
        load_config(env={"TIDE_A__B__C": "1"})
    with pytest.raises(ConfigError, match="enabled"):
        load_config(env={"TIDE_SPEC__ENABLED": "maybe"})


def test_secrets_redacted_in_logged_config():
    cfg = load_config(env={"TIDE_SERVER__CONTROL_TOKEN": "s3cret"})
    assert cfg.server.control_token == "s3cret"
    assert "s3cret" not in str(config_as_dict(cfg))


def test_plain_tide_env_markers_are_not_config():
    cfg = load_config(env={"TIDE_RETRAIN_JOB_ID": "x", "TIDE_RETRAIN_STATE_PATH": "/tmp/s", "TIDE_SPEC__DRAFT_LEN": "2"})
    assert cfg.spec.draft_len == 2


def test_env_lists_and_maps():
    cfg = load_config(env={"TIDE_SCHEDULE__K8S_TOLERATIONS": "gpu:NoSchedule, pool=training:NoSchedule ,",
                           "TIDE_SCHEDULE__K8S_NODE_SELECTOR": '{"amd.com/gpu.present": "true"}'})
    assert cfg.schedule.k8s_tolerations == ("gpu:NoSchedule", "pool=training:NoSchedule")
    assert dict(cfg.schedule.k8s_node_selector) == {"amd.com/gpu.present": "true"}


@pytest.mark.parametrize("old,new", [
    ("capture.bootstrap_servers", "kafka.bootstrap_servers"),
    ("capture.topic", "kafka.topic"),
    ("ingest.bootstrap_servers", "kafka.bootstrap_servers"),
    ("ingest.topic", "kafka.topic"),
    ("ingest.dead_letter_topic", "kafka.dead_letter_topic"),
])
def test_kafka_keys_moved_to_the_kafka_section_are_a_clear_error(tmp_path, old, new):
    # an old per-component copy of the address or topic must not be silently ignored
    section, key = old.split(".")
    f = tmp_path / "c.yaml"
    f.write_text(f"{section}:\n  {key}: x\n")
    with pytest.raises(ConfigError, match=rf"config\.{old} moved to {new}\b"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match=rf"moved to {new}\b"):
        load_config(env={f"TIDE_{section.upper()}__{key.upper()}": "x"})


def test_one_kafka_section_for_capture_and_ingest(tmp_path):
    cfg = load_config(env={})
    assert (cfg.kafka.bootstrap_servers, cfg.kafka.topic, cfg.kafka.dead_letter_topic) == (
        "127.0.0.1:9092", "tide.hidden-states", "tide.hidden-states.dead-letter")
    f = tmp_path / "c.yaml"
    f.write_text("kafka:\n  bootstrap_servers: k1:9092,k2:9092\n  topic: t\n")
    cfg = load_config(f, env={"TIDE_KAFKA__DEAD_LETTER_TOPIC": "t.dlq"})
    assert (cfg.kafka.bootstrap_servers, cfg.kafka.topic, cfg.kafka.dead_letter_topic) == (
        "k1:9092,k2:9092", "t", "t.dlq")


def test_k8s_env_values_and_url_passwords_never_reach_the_logged_config():
    cfg = load_config(env={}, overrides={
        "schedule": {"k8s_env": {"AWS_SECRET_ACCESS_KEY": "hunter2", "PLAIN": "also-hidden"},
                     "k8s_secret_env": {"MLFLOW_TRACKING_TOKEN": "tide-mlflow/token"}},
        "registry": {"tracking_uri": "https://bob:hunter2@mlflow.example:5000"}})
    logged = str(config_as_dict(cfg))
    assert "hunter2" not in logged and "also-hidden" not in logged
    d = config_as_dict(cfg)
    assert d["schedule"]["k8s_env"] == {"AWS_SECRET_ACCESS_KEY": "***", "PLAIN": "***"}  # names stay
    assert d["schedule"]["k8s_secret_env"] == {"MLFLOW_TRACKING_TOKEN": "tide-mlflow/token"}  # references
    assert d["registry"]["tracking_uri"] == "https://bob:***@mlflow.example:5000"


def test_the_service_start_log_and_registry_errors_hide_secrets(tmp_path, caplog):
    import logging
    import signal

    from tide import service
    from tide.config import RegistryConfig
    from tide.registry import Registry, RegistryError

    path = tmp_path / "c.yaml"
    path.write_text("schedule:\n  k8s_env: {HF_TOKEN: hunter2}\nregistry:\n"
                    "  tracking_uri: http://bob:hunter2@127.0.0.1:9\nserver:\n  control_token: hunter2\n")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with caplog.at_level(logging.INFO):
            cfg, _ = service.start("test", str(path), None)
    finally:  # start() installs the service's own handlers
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert "resolved config" in caplog.text and "hunter2" not in caplog.text
    with pytest.raises(RegistryError) as info:  # nothing listens on port 9
        Registry(RegistryConfig(tracking_uri=cfg.registry.tracking_uri, http_timeout_s=1), tmp_path)
    assert "hunter2" not in str(info.value) and "bob:***@" in str(info.value)


def test_service_flags_override_only_what_the_command_line_sets(tmp_path):
    import signal

    from tide import service
    from tide.services import engine, ingest, scheduler

    path = tmp_path / "c.yaml"
    path.write_text("server:\n  host: 0.0.0.0\n  port: 7000\nkafka:\n  bootstrap_servers: file-broker:9092\n")
    args = engine.parse_args(["--config", str(path), "--port", "9001"])
    assert args.port == 9001 and args.host is None  # typed; unset flags stay None
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        cfg, _ = service.start("test", args.config, service.flag_overrides(args, engine.FLAGS))
    finally:  # start() installs the service's own handlers
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert (cfg.server.port, cfg.server.host, cfg.kafka.bootstrap_servers) == (9001, "0.0.0.0", "file-broker:9092")
    got = service.flag_overrides(ingest.parse_args(["--data-dir", "/d", "--bootstrap-servers", "b:1"]), ingest.FLAGS)
    assert got == {"kafka": {"bootstrap_servers": "b:1"}, "ingest": {"data_dir": "/d"}}
    assert service.flag_overrides(scheduler.parse_args([]), scheduler.FLAGS) == {"ingest": {"data_dir": None}}
    with pytest.raises(SystemExit):  # a typed flag refuses a bad value at the command line
        engine.parse_args(["--port", "eighty"])


@pytest.mark.parametrize("spec,match", [({"scheduler": "greedy"}, "not one of"),
                                        ({"gate_probe_steps": 0}, "gate_probe_steps"),
                                        ({"draft_stop_prob": 1.5}, "draft_stop_prob"),
                                        ({"draft_len": 0}, "draft_len")])
def test_spec_scheduler_keys_are_validated(spec, match):
    with pytest.raises(ConfigError, match=match):
        load_config(env={}, overrides={"spec": spec})
    assert load_config(env={}, overrides={"spec": {"scheduler": "cost"}}).spec.scheduler == "cost"


def test_draft_siblings_outside_what_a_verify_pass_holds_is_refused():
    from tide.config import MAX_DRAFT_SIBLINGS, ConfigError, load_config
    from tide.models.rowkernel import PASS_ROWS

    assert MAX_DRAFT_SIBLINGS == PASS_ROWS - 1  # the bound is the kernel's pass width
    assert load_config(overrides={"spec": {"draft_siblings": MAX_DRAFT_SIBLINGS}}).spec.draft_siblings == 5
    for bad in (-1, MAX_DRAFT_SIBLINGS + 1, 10**9):
        with pytest.raises(ConfigError, match="draft_siblings"):
            load_config(overrides={"spec": {"draft_siblings": bad}})


def test_train_anchor_refused_when_negative_or_a_whole_step_of_drift():
    from tide.config import ConfigError, load_config

    assert load_config(env={}, overrides={"train": {"anchor": 5.0}}).train.anchor == 5.0
    for bad in (-1.0, 1000.0):  # x lr 1e-3: a pull of the whole drift (or back past the start)
        with pytest.raises(ConfigError, match="train.anchor"):
            load_config(env={}, overrides={"train": {"anchor": bad}})


def test_train_update_fraction_refused_outside_zero_to_one():
    assert load_config(env={}, overrides={"train": {"update_fraction": 1.0}}).train.update_fraction == 1.0
    for bad in (0.0, -0.5, 1.2):
        with pytest.raises(ConfigError, match="train.update_fraction"):
            load_config(env={}, overrides={"train": {"update_fraction": bad}})
