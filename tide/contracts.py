"""What TIDE's components exchange, defined once: record sizes, dead-letter reasons, retrain and job
statuses, registry aliases and lineage tag names, what capture takes from an engine and the
acceptance counters engines report.

Standard library only, so every process (engine, ingest, scheduler, a retrain Job, the CLI) can
import it without torch, MLflow or Kafka. A value here is a wire or storage contract: changing
one changes what older records, result files, registry tags or dashboards mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# --- capture records (tide/records.py encodes them; ingest, the dataset and training read them) ---
# bytes per stored hidden-state value, by storage dtype name
HIDDEN_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1}
# why a record went to the dead-letter topic (the reason header ingest writes)
DEAD_MALFORMED = "malformed"  # not a record: bad magic, CRC, header or sizes
DEAD_UNKNOWN_VERSION = "unknown_version"  # a schema version this ingest cannot read
DEAD_OVERSIZED = "oversized"  # larger than ingest.max_record_bytes
# a well-formed record whose values the dataset cannot hold: NaN/inf/out-of-range times, ids too
# long or not printable UTF-8, integers beyond int32, negative token ids, loss mask not 0/1
DEAD_INVALID = "invalid"
DEAD_UNPROCESSABLE = "unprocessable"  # ingest failed on this record unexpectedly (a bug: see the log)
# the workload of a request captured without a workload tag (the shift's mix, the replay's shares)
UNTAGGED_WORKLOAD = "untagged"

# --- the retrain command's result file (``tide train --online --result-json``) ---
RETRAIN_REGISTERED = "registered"  # a challenger version was registered
RETRAIN_NOTHING_TO_DO = "nothing_to_do"  # not enough readable data: no version, not a failure
RETRAIN_FAILED = "failed"
RETRAIN_SUCCESS_STATUSES = (RETRAIN_REGISTERED, RETRAIN_NOTHING_TO_DO)
# result key: the dataset table version the retrain read (the one version it planned its window
# on); on success the scheduler's watermark moves there. Also in the summary (Kubernetes Jobs).
RESULT_DATA_WATERMARK = "data_table_version"

# --- how a launched retrain job ended (scheduler state, metrics label ``outcome``) ---
JOB_SUCCEEDED = "succeeded"
JOB_FAILED = "failed"
JOB_TIMED_OUT = "timed_out"
JOB_CANCELLED = "cancelled"  # stopped on purpose (scheduler shutdown): no backoff
JOB_OUTCOMES = (JOB_SUCCEEDED, JOB_FAILED, JOB_TIMED_OUT, JOB_CANCELLED)

# --- sampling: what the server and every engine agree a request means ---
# Temperatures below this are greedy, as in vLLM/SGLang: dividing logits by 1e-40 overflows to
# inf/NaN inside the batch, and the distribution is one-hot long before that anyway.
GREEDY_TEMPERATURE = 1e-5

# --- registry: aliases engines follow and operators move ---
CHAMPION, CHALLENGER, PREVIOUS_CHAMPION = "champion", "challenger", "previous-champion"

# --- registry: version and run tags (lineage); MLflow stores every value as a string ---
TAG_KIND = "tide.kind"  # static | retrain
TAG_REGISTRATION = "tide.registration"  # pending | complete
TAG_PARENT = "tide.parent_version"  # the version the retrain warm-started from
TAG_WINDOW_START = "tide.data_window_start_s"  # capture time span of the recent window
TAG_WINDOW_END = "tide.data_window_end_s"
TAG_RECENT_REQUESTS = "tide.recent_requests"
TAG_REPLAY_REQUESTS = "tide.replay_requests"
# training samples from outside the table: the rehearsal pool (tide/train/rehearsal.py), by count and pool file
TAG_REHEARSAL_REQUESTS = "tide.rehearsal_requests"
TAG_REHEARSAL_POOL = "tide.rehearsal_pool"
TAG_HELDOUT_REQUESTS = "tide.heldout_requests"
TAG_HELDOUT_POSITIONS = "tide.heldout_positions"
TAG_TRAIN_TOKENS = "tide.train_tokens"
TAG_DATA_VERSION = "tide.data_table_version"  # the dataset table version the retrain read
TAG_DATA_URI = "tide.data_table_uri"  # the dataset table it read (no credentials: they never are in it)
TAG_RUN_ID = "tide.run_id"  # the MLflow run that trained it
TAG_REGISTERED_VERSION = "tide.registered_version"  # run tag: the version the run registered
TAG_CHECKSUM = "tide.artifact_sha256"  # digest of the whole drafter folder (folder_digest)
TAG_WEIGHTS_SHA = "tide.weights_sha256"  # sha256 of model.safetensors (also in tide.json)
TAG_VOCAB = "tide.vocab_mapping"
TAG_CODE = "tide.code_version"
TAG_SIM_ACCEPT = "tide.sim_accept_length"  # this version, on its run's held-out slice
TAG_PARENT_SIM_ACCEPT = "tide.parent_sim_accept_length"  # its parent, same slice
# the version the held-out comparison (and the promotion policy) is against: the champion when the
# retrain launched ("static" when none), which is the parent unless the retrain rebased past a patch
TAG_BASELINE = "tide.baseline_version"
TAG_BASELINE_SIM_ACCEPT = "tide.baseline_sim_accept_length"  # the baseline, same slice
TAG_PATCH = "tide.patch"  # "true": a shift's quick retrain; later retrains warm-start past it
TAG_ROLLED_BACK = "tide.rolled_back"  # set on the version a rollback moved away from (its reason)
TAG_HOST, TAG_PID = "tide.host", "tide.pid"  # who holds a pending registration
OP_TAG_PREFIX = "tide.op."  # registered-model tags: one per promote/rollback


# --- a captured request's facts (the engine's tap writes them, the capture worker reads them) ---
@dataclass(frozen=True)
class CaptureMeta:
    """Request-level facts a capture record needs; shared by all of a request's steps."""

    request_id: str
    target_model_id: str
    drafter_version: str
    aux_layer_ids: tuple[int, ...]
    workload: str | None
    prompt_len: int
    started_at_s: float


@dataclass
class StepCapture:
    """Target tensors for the positions one step *committed* for one request.

    ``token_ids[i]`` was fed to the target at position ``start_position + i``;
    ``aux_hidden[i]`` ([3H], the inputs of the aux layers) and ``final_hidden[i]`` ([H], after the
    final norm) are what the target computed there. Rejected draft positions are never included.
    Tensors are references to the engine's step outputs (no copy on the hot path); sinks must not
    modify them. They are torch tensors, typed loosely so this module needs no torch.
    """

    meta: CaptureMeta
    start_position: int
    token_ids: Any  # torch.Tensor [n] int64
    aux_hidden: Any  # torch.Tensor [n, 3H]
    final_hidden: Any  # torch.Tensor [n, H]
    is_prompt: bool  # True for prefill positions (loss mask 0), False for generated ones
    finished: bool = False  # the request ended after this step


# --- an engine's acceptance per drafter version (engine stats, the drafter service's wire, ops) ---
@dataclass(frozen=True)
class VersionAcceptance:
    """One drafter version's cumulative acceptance counters on one engine, since the engine started.

    Only rows whose drafts the target verified count: a row decoded target-only while a drafter
    serves says nothing about the drafter. With no drafter (version "none") every row counts.
    ``forwards``: rows verified, one target forward of one request each (a step of B rows adds B);
    ``accepted``: draft tokens the target accepted on them;
    ``committed``: tokens those rows committed (the accepted drafts plus the target's own token).
    ``committed / forwards`` is the acceptance length: tokens per target forward.
    """

    forwards: int = 0
    accepted: int = 0
    committed: int = 0

    @property
    def tokens_per_forward(self) -> float:
        """The acceptance length (0.0 before any forward)."""
        return self.committed / self.forwards if self.forwards else 0.0

    def __add__(self, other: "VersionAcceptance") -> "VersionAcceptance":
        return VersionAcceptance(self.forwards + other.forwards, self.accepted + other.accepted,
                                 self.committed + other.committed)

    def __sub__(self, other: "VersionAcceptance") -> "VersionAcceptance":
        return VersionAcceptance(self.forwards - other.forwards, self.accepted - other.accepted,
                                 self.committed - other.committed)
