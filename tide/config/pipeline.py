"""The data side's sections: the Kafka topics, capture and ingest, training, and the retrain scheduler."""
from __future__ import annotations

from typing import ClassVar, Literal, Mapping

from pydantic import Field, model_validator

from tide.config.base import Section


class KafkaConfig(Section):
    """The Kafka address and topics, one section shared by capture and ingest.

    Rule: the engine's capture produces to ``topic``; ingest consumes ``topic`` and sends what it
    cannot store to ``dead_letter_topic``. Both read this one section, so they cannot disagree.
    """

    section: ClassVar[str] = "kafka"
    bootstrap_servers: str = "127.0.0.1:9092"  # comma-separated host:port list
    topic: str = "tide.hidden-states"
    dead_letter_topic: str = "tide.hidden-states.dead-letter"


class CaptureConfig(Section):
    """Hidden-state capture (engine side) and its Kafka producer (address and topic: ``kafka``)."""

    section: ClassVar[str] = "capture"
    enabled: bool = False
    queue_max_items: int = 256  # staged steps the worker holds before its producer thread
    # shared memory the tap stages step rows in for the capture worker; full -> steps dropped
    staging_bytes: int = 32 * 1024 * 1024
    sample_fraction: float = 1.0
    max_tokens_per_request: int = 2048
    # per-workload sampling fractions, e.g. {"code": 0.5}; workloads not named use sample_fraction
    workload_fractions: Mapping[str, float] = Field(default_factory=dict)
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
    full_capture_fraction: float = Field(0.0, ge=0.0, le=1.0)


class IngestConfig(Section):
    """Kafka -> Delta table ingest service, the dataset it writes, and that dataset's retention.

    Address and topics are the ``kafka`` section's; how ingest creates those topics is set here."""

    section: ClassVar[str] = "ingest"
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
    storage_options: Mapping[str, str] = Field(default_factory=dict)
    # the tansu broker holds a JoinGroup for about session_timeout/2 before answering: keep it short
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 2000
    poll_timeout_s: float = 0.5
    # while the replica holds no partitions (joining, rebalancing) a poll waits up to this long; it
    # must outlast the broker's JoinGroup hold (above; Kafka's group.initial.rebalance.delay.ms, 3 s
    # by default): kafka-python 3.0.12 drops a join that completes between two polls and joins
    # again, so a join that outlasts each poll starts a fresh rebalance of the whole group
    join_poll_timeout_s: float = Field(6.0, gt=0)
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
    # glibc's allocator: buffers below this come from the heap, not a fresh mmap each (every
    # fetch-sized buffer would fault its pages in again); glibc caps it at 32 MiB. 0 = leave it
    malloc_mmap_threshold_bytes: int = Field(32 * 1024 * 1024, ge=0, le=32 * 1024 * 1024)
    # freed heap kept for reuse up to this before it goes back to the system: above a fetch's
    # buffers in flight (fetch_max_bytes, a few times over), under the service's memory budget
    malloc_trim_threshold_bytes: int = Field(256 * 1024 * 1024, ge=0)
    # bytes per socket read of the Kafka consumer (kafka-python reads 4 KiB); 0 = leave it
    socket_read_bytes: int = Field(1024 * 1024, ge=0)


class TrainConfig(Section):
    """Offline/online EAGLE3 training."""

    section: ClassVar[str] = "train"
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
    anchor: float = Field(0.0, ge=0.0)
    # the candidate keeps this fraction of its weights' change from the parent (WiSE-FT): below 1 it
    # gives up a little of the new traffic's gain for much of the old traffic's loss; 1 = as trained.
    # A stronger parent has more old traffic to lose, so it wants a lower fraction
    # (bench/retrain_variants.py --fractions scores candidates on a real window).
    # Applied after training, whichever backend trains; static training has no parent to keep
    update_fraction: float = Field(0.6, gt=0.0, le=1.0)
    # a candidate under keep_workloads x the parent's held-out acceptance on a workload tag measured
    # on >= keep_min_positions positions keeps less of its change: the fraction steps down by 0.1 to
    # min_update_fraction until no tag is under (tide/train/fraction.py). 0 = off (the default):
    # update_fraction as set. A step-down can leave a candidate that no longer beats the champion, and
    # the promotion policy then keeps the champion, whatever it lost of the old workload
    keep_workloads: float = Field(0.0, ge=0.0, lt=1.0)
    keep_min_positions: int = Field(200, ge=1)  # fewer held-out positions of a tag: too few to steer by
    min_update_fraction: float = Field(0.4, gt=0.0, le=1.0)
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
    # set by the scheduler for a shift's retrain: a short run on a small window at a high update
    # fraction, registered as a patch (tide.patch) that serves until a full retrain replaces it
    patch: bool = False
    # a retrain whose champion is a patch warm-starts from the patch's own parent (the newest
    # non-patch ancestor) and is compared against the champion: a patch's overfit to its small
    # window is not inherited (on a demo window it kept 0.97 of the old workload's acceptance where
    # warm-starting from the patch kept 0.92; docs/benchmarks.md, "Retrain settings on a demo window")
    rebase_patches: bool = True
    # older requests replayed per recent training request: what keeps the older workloads'
    # acceptance while the drafter learns the new one (docs/benchmarks.md)
    replay_ratio: float = 1.0
    # share the replay evenly among the older requests' workload tags (a tag holding less than
    # its share gives all it has): a workload served briefly before a shift is not outnumbered
    # by the new traffic the token cap left out of the recent window
    replay_by_workload: bool = True
    # rehearsal (tide/train/rehearsal.py): when the dataset holds fewer older requests than the
    # replay asks (a young dataset: the first retrains after a shift), the target's own answers to
    # prompts of the workload the drafter was trained on fill the shortfall, up to this many
    # (0 = off). Generated once per home and target, cached under <home>/train-cache/rehearsal;
    # a shift's patch trains without it. At most 1024: a retrain reads the pool whole into memory
    # (every token's aux and final states: 4 x hidden size x 2 bytes)
    rehearsal_prompts: int = Field(128, ge=0, le=1024)
    rehearsal_workload: str = "chat"  # a built-in workload's name or a JSONL file; its train split
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
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16", "auto"] = "fp32"  # auto = bf16 where the device has native bf16
    # who trains: TIDE's trainer, or SpecForge's EAGLE3 trainer where it is installed with a GPU
    # (tide/train/specforge_backend.py; refused before any work otherwise)
    backend: Literal["tide", "specforge"] = "tide"

    @model_validator(mode="after")
    def _anchor_below_a_whole_step(self) -> TrainConfig:
        if self.anchor * self.lr >= 1.0:  # each step would pull back the whole drift, or past the start
            raise ValueError(f"config.train.anchor x config.train.lr must stay below 1, got {self.anchor} x {self.lr}")
        return self


class ScheduleConfig(Section):
    """Retrain scheduler: when a retrain launches, how (local process or Kubernetes Job), its lease."""

    section: ClassVar[str] = "schedule"
    interval_s: float = Field(60.0, gt=0)  # how often the trigger policy runs
    # launch when this many new samples (in sample_unit, from the table log) arrived since the
    # last successful retrain; units: tokens | generated_tokens | requests | rows
    min_new_samples: int = Field(50_000, ge=0)
    sample_unit: Literal["tokens", "generated_tokens", "requests", "rows"] = "tokens"
    target_model: str = ""  # count only this target model's data; empty = all
    cooldown_s: float = Field(1800.0, ge=0)  # after a successful retrain, wait at least this long
    job_timeout_s: float = Field(3600.0, gt=0)  # a retrain running longer is killed and recorded timed_out
    kill_grace_s: float = Field(10.0, ge=0)  # SIGTERM -> SIGKILL of a local job's process group
    # on shutdown, kill a running retrain and record it "cancelled" instead of leaving it to the
    # next scheduler. Off for a long-lived scheduler (a retrain outlives its restarts); the local
    # stack (`tide up`/`tide demo`) turns it on: it stops the MLflow the retrain would report to
    cancel_on_stop: bool = False
    backoff_base_s: float = Field(60.0, ge=0)  # after n consecutive failures wait base * 2**(n-1) s ...
    backoff_max_s: float = Field(3600.0, ge=0)  # ... at most this long
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
    # (shift_window_from_shift: then only samples committed since then count toward it)
    shift_detection: bool = True
    shift_recent_tokens: int = Field(2000, gt=0)
    shift_reference_tokens: int = Field(8000, gt=0)
    shift_mix_distance: float = Field(0.5, gt=0.0, le=1.0)
    shift_metrics_urls: tuple[str, ...] = ()
    shift_accept_window_s: float = Field(120.0, gt=0)
    shift_accept_drop: float = Field(0.15, gt=0.0, le=1.0)
    shift_accept_min_forwards: int = Field(200, ge=0)
    shift_min_new_samples: int = Field(10_000, ge=0)
    shift_train: Mapping[str, str] = Field(default_factory=lambda: {"max_train_s": "240"})
    shift_window_from_shift: bool = True  # the shift's retrain: recent = what came since the shift, + replay
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9103  # /metrics and /health; 0 = none
    k8s_namespace: str = "tide"
    k8s_image: str = "tide:latest"
    k8s_image_pull_policy: str = "IfNotPresent"
    k8s_service_account: str = ""
    k8s_job_name_prefix: str = "tide-retrain"
    k8s_node_selector: Mapping[str, str] = Field(default_factory=dict)  # the training pool
    k8s_tolerations: tuple[str, ...] = ()  # "key=value:Effect" or "key:Effect" (operator Exists)
    k8s_gpu_resource: str = "nvidia.com/gpu"  # or amd.com/gpu
    k8s_gpu_count: int = 1  # 0 = CPU-only job
    k8s_cpu: str = "4"
    k8s_memory: str = "4Gi"  # twice the retrain peak at 4x the bench window (the ConfigMap states the rule)
    # extra plain env for the job's container: no credentials (a name that looks like one, or a
    # URL with a password, is refused at start); those go in k8s_secret_env
    k8s_env: Mapping[str, str] = Field(default_factory=dict)
    # env from Kubernetes Secrets: {NAME: "secret-name/key"} -> secretKeyRef (values never pass here)
    k8s_secret_env: Mapping[str, str] = Field(default_factory=dict)
    k8s_tide_home: str = "/var/lib/tide"  # TIDE_HOME in k8s_image; the Job's writable folders are under it
    k8s_config_map: str = ""  # ConfigMap with key config.yaml, mounted at /etc/tide in the job
    k8s_ttl_after_finished_s: int = 86400
    k8s_in_cluster: bool = True  # False = use ~/.kube/config (running outside the cluster)
