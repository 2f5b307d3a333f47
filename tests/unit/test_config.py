"""Config loading: defaults, YAML, env overlay, unknown keys rejected, types coerced."""
import re

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


def _load_in(layer: str, tmp_path, section: str, key: str, value):
    """``section.key = value`` set by one layer: the YAML file, the environment or an override."""
    if layer == "file":
        path = tmp_path / "c.yaml"
        path.write_text(f"{section}:\n  {key}: {value}\n")
        return load_config(path, env={})
    if layer == "env":
        return load_config(env={f"TIDE_{section.upper()}__{key.upper()}": str(value)})
    return load_config(env={}, overrides={section: {key: value}})


@pytest.mark.parametrize("layer", ["file", "env", "override"])
@pytest.mark.parametrize("section,key,value", [("spec", "draft_len", "three"), ("spec", "draft_len", 0),
                                               ("schedule", "interval_s", 0), ("train", "update_fraction", 1.5),
                                               ("schedule", "sample_unit", "bytes"), ("server", "port", 1.5)])
def test_a_bad_value_names_its_key_and_the_value_in_every_layer(tmp_path, layer, section, key, value):
    with pytest.raises(ConfigError, match=rf"^config\.{section}\.{key}: .*, got '?{re.escape(str(value))}'?$"):
        _load_in(layer, tmp_path, section, key, value)


@pytest.mark.parametrize("layer", ["file", "env", "override"])
def test_an_unknown_key_is_named_with_the_known_ones(tmp_path, layer):
    with pytest.raises(ConfigError, match=r"config\.spec: unknown key\(s\) \['draft_lenn'\]; known: \[.*'draft_len'"):
        _load_in(layer, tmp_path, "spec", "draft_lenn", 3)
    with pytest.raises(ConfigError, match=r"config: unknown key\(s\) \['nosuch'\]; known: \[.*'spec'"):
        _load_in(layer, tmp_path, "nosuch", "a", 1)


@pytest.mark.parametrize("section,key,bad,good", [
    ("schedule", "interval_s", 0, 0.5), ("schedule", "min_new_samples", -1, 0),
    ("schedule", "shift_mix_distance", 0.0, 1.0), ("schedule", "shift_accept_drop", 1.01, 0.01),
    ("spec", "draft_stop_prob", -0.1, 0.0), ("spec", "drafter_service_deadline_s", 0, 0.01),
    ("capture", "full_capture_fraction", 1.01, 1.0), ("drafter_service", "session_idle_s", 0, 1),
])
def test_a_range_rule_on_a_field_refuses_out_of_range_values_naming_the_key(section, key, bad, good):
    from tide.config import TideConfig

    assert getattr(getattr(load_config(env={}, overrides={section: {key: good}}), section), key) == good
    with pytest.raises(ConfigError, match=rf"^config\.{section}\.{key}: .*, got {re.escape(str(bad))}$"):
        load_config(env={}, overrides={section: {key: bad}})
    section_model = TideConfig.model_fields[section].annotation
    with pytest.raises(ConfigError, match=rf"^config\.{section}\.{key}: "):  # built in code: the same rule
        section_model(**{key: bad})


def test_rules_across_two_fields_name_both_keys():
    with pytest.raises(ConfigError, match=r"config\.drafter_service\.max_batch_rows.*config\.drafter_service\.max_sessions"):
        load_config(env={}, overrides={"drafter_service": {"max_batch_rows": 9, "max_sessions": 8}})
    with pytest.raises(ConfigError, match=r"config\.train\.anchor x config\.train\.lr"):
        load_config(env={"TIDE_TRAIN__ANCHOR": "20", "TIDE_TRAIN__LR": "0.05"})


def test_environment_values_are_read_as_the_fields_say(monkeypatch):
    for word, expected in [("1", True), ("true", True), ("Yes", True), (" on ", True),
                           ("0", False), ("false", False), ("NO", False), ("off", False)]:
        assert load_config(env={"TIDE_CAPTURE__ENABLED": word}).capture.enabled is expected, word
    with pytest.raises(ConfigError, match=r"^config\.capture\.enabled: expected a bool.*, got '2'$"):
        load_config(env={"TIDE_CAPTURE__ENABLED": "2"})
    cfg = load_config(env={"TIDE_MODEL__AUX_LAYER_IDS": "2, 15 ,27", "TIDE_SGLANG__EXTRA_ARGS": "--a,--b",
                           "TIDE_CAPTURE__WORKLOAD_FRACTIONS": '{"code": 0.5, "chat": "1"}',
                           "TIDE_SCHEDULE__SHIFT_TRAIN": '{"epochs": 2}', "TIDE_SERVER__PORT": "9001",
                           "TIDE_SCHEDULE__K8S_CPU": "4", "TIDE_OPS__SMOKE_PROMPT": "true"})
    assert cfg.model.aux_layer_ids == (2, 15, 27) and cfg.sglang.extra_args == ("--a", "--b")
    assert dict(cfg.capture.workload_fractions) == {"code": 0.5, "chat": 1.0}
    assert dict(cfg.schedule.shift_train) == {"epochs": "2"}  # a str-typed value takes anything
    assert (cfg.server.port, cfg.schedule.k8s_cpu, cfg.ops.smoke_prompt) == (9001, "4", "true")
    assert load_config(env={}, overrides={"ops": {"smoke_prompt": 5}}).ops.smoke_prompt == "5"
    for name, value in [("TIDE_SERVER__PORT", "1.5"), ("TIDE_MODEL__AUX_LAYER_IDS", "1,x"),
                        ("TIDE_SCHEDULE__K8S_NODE_SELECTOR", "{not json")]:
        section, key = name[len("TIDE_"):].lower().split("__")
        with pytest.raises(ConfigError, match=rf"config\.{section}\.{key}\b"):
            load_config(env={name: value})
    monkeypatch.setenv("TIDE_SERVER__PORT", "9002")
    assert load_config(env={}).server.port == 8000  # a given mapping is the whole environment
    assert load_config().server.port == 9002  # env=None: os.environ


def test_a_mapping_set_by_two_layers_is_the_later_one_whole(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("schedule:\n  k8s_env: {A: '1'}\n  k8s_namespace: from-file\n")
    cfg = load_config(path, env={}, overrides={"schedule": {"k8s_env": {"B": "2"}}})
    assert dict(cfg.schedule.k8s_env) == {"B": "2"} and cfg.schedule.k8s_namespace == "from-file"


def test_replace_is_checked_like_a_load_and_the_config_stays_frozen():
    from tide.config import replace

    cfg = load_config(env={})
    changed = replace(cfg, spec=replace(cfg.spec, draft_len=2))
    assert (changed.spec.draft_len, cfg.spec.draft_len, changed.server) == (2, 4, cfg.server)
    with pytest.raises(ConfigError, match=r"^config\.spec\.draft_len: .*, got 0$"):
        replace(cfg.spec, draft_len=0)
    with pytest.raises(ValueError):
        cfg.spec.draft_len = 3
    assert cfg.model_dump()["spec"]["draft_len"] == 4 and "draft_len" in type(cfg.spec).model_fields
