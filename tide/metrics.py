"""Every Prometheus metric TIDE exports, defined once.

Dashboards (dashboards/) and Kubernetes manifests (k8s/) reference these names; grep here first.
Sections are owned by components; add new metrics to your component's section.
Naming: ``tide_<component>_<what>_<unit>``; counters end in ``_total``.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# --- engine -----------------------------------------------------------------------------------
ENGINE_REQUESTS = Counter("tide_engine_requests_total", "Requests finished, by outcome", ["outcome"])
ENGINE_TOKENS = Counter("tide_engine_generated_tokens_total", "Tokens generated", ["drafter_version"])
ENGINE_TARGET_FORWARDS = Counter(
    "tide_engine_target_forwards_total", "Target forward passes in decode steps (per request row)",
    ["drafter_version"])
ENGINE_DRAFT_TOKENS = Counter(
    "tide_engine_draft_tokens_total", "Draft tokens proposed", ["drafter_version"])
ENGINE_ACCEPTED_TOKENS = Counter(
    "tide_engine_accepted_draft_tokens_total", "Draft tokens accepted by verification",
    ["drafter_version"])
ENGINE_SIBLING_ACCEPTS = Counter(
    "tide_engine_sibling_accepts_total", "Drafted rows whose first accepted token was a depth-1 sibling "
    "(spec.draft_siblings), not the chain's first draft", ["drafter_version"])
ENGINE_ACCEPT_LENGTH = Histogram(
    "tide_engine_accept_length_tokens", "Tokens committed per target forward (accepted + bonus) of rows with verified "
    "drafts (all rows when no drafter serves)",
    ["drafter_version"], buckets=(1, 2, 3, 4, 5, 6, 7, 8, 9))
ENGINE_STEP_SECONDS = Histogram(
    "tide_engine_step_seconds", "Wall time of one batched decode step",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2))
ENGINE_BATCH_SIZE = Gauge("tide_engine_batch_size", "Requests in the running batch")
ENGINE_QUEUE_DEPTH = Gauge("tide_engine_queue_depth", "Requests waiting to be admitted")
ENGINE_DRAFTER_FAILURES = Counter(
    "tide_engine_drafter_failures_total", "Decode steps where the drafter raised and the step ran target-only")
ENGINE_DRAFTER_INFO = Gauge("tide_engine_drafter_info", "1 for the drafter version now serving",
                            ["drafter_version"])
ENGINE_DRAFTER_LOADS = Counter(
    "tide_engine_drafter_loads_total", "Drafter loads inside the engine process (SGLang's TIDE loader), by outcome",
    ["outcome"])
ENGINE_CONFIDENCE_HEAD = Gauge(
    "tide_engine_confidence_head", "1 while the drafter version's confidence head ranks its drafts, 0 while "
    "the top-probability chain does (no head, or its held-out ECE is unrecorded or above 0.05)", ["drafter_version"])
ENGINE_SWAP_FAILURES = Counter(
    "tide_engine_swap_failures_total", "Drafter swaps the decode loop could not apply (the old drafter kept serving)")
ENGINE_FAILED = Gauge(
    "tide_engine_failed", "1 once the decode loop has died: the engine serves no more (health answers 503)")
ENGINE_SWAP_PAUSE_SECONDS = Histogram(
    "tide_engine_swap_pause_seconds", "Time the decode loop spent applying one drafter swap",
    buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1))

ENGINE_STEP_COST_SECONDS = Gauge(
    "tide_engine_step_cost_seconds", "The engine's measured step cost (start-up profile, then a running average "
    "of live steps): kind=verify by rows and tokens fed, kind=draft by rows and draft depth, "
    "kind=overhead|overhead_drafted by rows (a step's time outside its forwards; tokens=0)",
    ["kind", "rows", "tokens"])
ENGINE_STEP_COST_SPEED = Gauge(
    "tide_engine_step_cost_speed", "Every step cost of a group (target: verify forwards; drafter: draft forwards) "
    "over its start-up figure, as live steps measure it: above 1 the machine or the contexts got slower, and cells "
    "no live step visits are scaled by it", ["group"])
ENGINE_SPEC_ENABLED = Gauge(
    "tide_engine_speculation_enabled", "1 while the cost scheduler speculates for the workload under the serving "
    "drafter, 0 while that workload decodes target-only", ["workload", "drafter_version"])
ENGINE_SPEC_GATE_CHANGES = Counter(
    "tide_engine_speculation_gate_changes_total", "Speculation switched on or off for a workload, by reason "
    "(acceptance_pays | acceptance_below_cost | drafter_swapped)", ["workload", "drafter_version", "reason"])
ENGINE_TARGET_ONLY_STEPS = Counter(
    "tide_engine_target_only_steps_total", "Decode steps the cost scheduler ran without the drafter, by reason "
    "(cost: drafting would not pay at this load, or no row has a token budget left for a draft; gated: every row's workload has speculation off; measured: "
    "drafted steps at this batch size delivered fewer tokens/s than a target-only step)", ["reason"])

# the reference engine's remote-drafter mode (tide/drafting/client.py)
ENGINE_REMOTE_DRAFTER_UP = Gauge("tide_engine_remote_drafter_up",
                                 "1 while the drafter service answers this engine (spec.drafter_service)")
ENGINE_REMOTE_DRAFTER_FALLBACKS = Counter(
    "tide_engine_remote_drafter_fallback_steps_total", "Decode steps run target-only because the drafter service "
    "did not serve them (deadline: no reply in time; down: marked down, not asked; send_failed: its queue full or no "
    "connection; version_change: drafts of a newly served version, switched to for the next step; error)", ["reason"])
ENGINE_REMOTE_DRAFTER_SECONDS = Histogram(
    "tide_engine_remote_drafter_round_trip_seconds", "From sending a step's rows to the drafter service to its drafts",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32))

# --- engine HTTP front end (tide/engine/server.py) ----------------------------------------------
HTTP_REQUESTS = Counter("tide_engine_http_requests_total", "HTTP requests answered, by route and status",
                        ["route", "status"])
HTTP_REQUEST_SECONDS = Histogram(
    "tide_engine_http_request_seconds", "Wall time from request to last byte (streams included)",
    ["route"], buckets=(0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
HTTP_INFLIGHT = Gauge("tide_engine_http_inflight_generations", "Generation requests being served")
HTTP_CONNECTIONS = Gauge("tide_engine_http_connections", "HTTP connections being served (lingering closes not counted)")
HTTP_CONNECTIONS_REFUSED = Counter(
    "tide_engine_http_connections_refused_total",
    "Connections refused or closed by the server's limits: limit (503 at connect), evicted (gave its place "
    "to a newcomer), header_timeout, body_timeout", ["reason"])
HTTP_TTFT_SECONDS = Histogram(
    "tide_engine_time_to_first_token_seconds", "Request arrival to the engine's first token event",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))

# --- capture (tide/capture/) --------------------------------------------------------------------
CAPTURE_QUEUE_DEPTH = Gauge("tide_capture_queue_depth", "Steps staged by the tap that the capture worker has not taken yet")
CAPTURE_REQUESTS = Counter("tide_capture_requests_total",
                           "Requests seen by the tap, by sampling decision", ["decision"])
CAPTURE_STEPS = Counter("tide_capture_enqueued_steps_total", "Step captures enqueued by the tap")
CAPTURE_DROPPED_STEPS = Counter(
    "tide_capture_dropped_steps_total", "Step captures the tap did not enqueue, by reason",
    ["reason"])
CAPTURE_DROPPED_RECORDS = Counter(
    "tide_capture_dropped_records_total", "Request records not delivered to Kafka, by reason",
    ["reason"])
CAPTURE_PRODUCED_RECORDS = Counter(
    "tide_capture_produced_records_total", "Request records whose every chunk the broker acknowledged")
CAPTURE_PRODUCED_MESSAGES = Counter("tide_capture_produced_messages_total",
                                    "Kafka messages (chunks) acknowledged")
CAPTURE_PRODUCED_BYTES = Counter("tide_capture_produced_bytes_total",
                                 "Value bytes of acknowledged messages (before compression)")
CAPTURE_PRODUCED_TOKENS = Counter("tide_capture_produced_tokens_total",
                                  "Positions in acknowledged records")
CAPTURE_PRODUCE_ERRORS = Counter("tide_capture_produce_errors_total",
                                 "Failed sends or deliveries, by error class", ["error"])
CAPTURE_UNACKED_BYTES = Gauge("tide_capture_unacked_bytes", "Bytes sent but not yet acknowledged")
CAPTURE_OPEN_REQUESTS = Gauge("tide_capture_open_requests",
                              "Requests whose steps the capture worker is accumulating")
CAPTURE_BROKER_UP = Gauge("tide_capture_broker_connected", "1 while the producer has a broker")
CAPTURE_WORKER_RESTARTS = Counter("tide_capture_worker_restarts_total",
                                  "Capture worker processes that exited unasked and were restarted")
CAPTURE_PREFIX_CACHED_POSITIONS = Counter(
    "tide_capture_prefix_cached_positions_total", "Positions of sampled requests left out of capture because "
    "SGLang's prefix cache served the start of their prompt (prompt positions + committed output tokens)")
CAPTURE_RANK_UNKNOWN = Counter(
    "tide_capture_rank_unknown_total", "SGLang scheduler processes started without capture because their "
    "parallel rank could not be read (capturing on every rank would duplicate records)")
# what the capture worker process counts; it reports them to the engine process, which serves them
CAPTURE_WORKER_COUNTERS = (CAPTURE_DROPPED_RECORDS, CAPTURE_PRODUCED_RECORDS, CAPTURE_PRODUCED_MESSAGES,
                           CAPTURE_PRODUCED_BYTES, CAPTURE_PRODUCED_TOKENS, CAPTURE_PRODUCE_ERRORS)
CAPTURE_WORKER_GAUGES = (CAPTURE_UNACKED_BYTES, CAPTURE_OPEN_REQUESTS, CAPTURE_BROKER_UP)

# --- ingest (tide/dataset/) -----------------------------------------------------------------------
INGEST_MESSAGES = Counter("tide_ingest_messages_total", "Messages consumed, by outcome",
                          ["outcome"])  # written | dead_lettered | duplicate
INGEST_DEAD_LETTERED = Counter("tide_ingest_dead_lettered_total",
                               "Messages sent to the dead-letter topic, by reason", ["reason"])
INGEST_ROWS = Counter("tide_ingest_rows_total", "Rows (record chunks) in committed Parquet files")
INGEST_TOKENS = Counter("tide_ingest_tokens_total", "Positions in committed Parquet files")
INGEST_FILES = Counter("tide_ingest_files_total", "Parquet files made durable")
INGEST_FILE_BYTES = Counter("tide_ingest_file_bytes_total", "Bytes of Parquet files made durable")
INGEST_COMMITS = Counter("tide_ingest_commits_total", "Offset commits, by outcome", ["outcome"])
INGEST_COMMIT_LAG = Gauge("tide_ingest_commit_lag_messages",
                          "Messages consumed but not yet committed (in open files)")
INGEST_LAST_COMMIT = Gauge("tide_ingest_last_commit_timestamp_seconds", "Unix time of last commit")
INGEST_FLUSH_SECONDS = Histogram(
    "tide_ingest_flush_seconds", "Close + fsync + rename + index + commit of one flush",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
INGEST_DATASET_BYTES = Gauge("tide_ingest_dataset_bytes", "Bytes of Parquet files in the dataset")
INGEST_DATASET_FILES = Gauge("tide_ingest_dataset_files", "Parquet files in the dataset")
INGEST_RETENTION_DELETED = Counter(
    "tide_ingest_retention_deleted_files_total", "Files deleted or rewritten by retention, by reason",
    ["reason"])  # ttl | size | request
INGEST_WRITE_BLOCKED = Gauge(
    "tide_ingest_write_blocked", "1 from a failed write until one succeeds; ingest consumes nothing "
    "while it waits (by reason)", ["reason"])  # disk_full | write_error
INGEST_WRITE_BACKOFF_SECONDS = Gauge("tide_ingest_write_backoff_seconds",
                                     "Current wait before ingest retries a failed write (0 = writing)")
INGEST_WRITE_FAILURES = Counter("tide_ingest_write_failures_total",
                                "Failed seals (file, index or dead letters), by reason", ["reason"])
INGEST_OFFSET_GAPS = Counter(
    "tide_ingest_offset_gaps_total", "Fetches that skipped offsets of a capture partition (it has no "
    "transactions or compaction, so every offset holds a record), by outcome", ["outcome"])  # refetched | passed
INGEST_DROPPED_ROWS = Counter(
    "tide_ingest_dropped_rows_total", "Consumed rows not written because the dataset already "
    "deleted them, by reason", ["reason"])  # request_deleted | expired

# --- scheduler (tide/schedule/) -------------------------------------------------------------------
SCHED_RETRAINS_LAUNCHED = Counter("tide_scheduler_retrains_launched_total",
                                  "Retrain jobs launched", ["launcher"])
SCHED_RETRAINS_FINISHED = Counter(
    "tide_scheduler_retrains_finished_total", "Retrain jobs finished, by outcome",
    ["outcome"])  # succeeded | failed | timed_out | cancelled
SCHED_RETRAINS_NOTHING_TO_DO = Counter(
    "tide_scheduler_retrains_nothing_to_do_total",
    "Succeeded retrain jobs that found too little readable data and registered no version")
SCHED_RETRAIN_SECONDS = Histogram(
    "tide_scheduler_retrain_seconds", "Wall time of a retrain job, launch to finish",
    buckets=(10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200))
SCHED_NEW_SAMPLES = Gauge("tide_scheduler_new_samples",
                          "Samples (schedule.sample_unit) since the last successful retrain")
SCHED_THRESHOLD = Gauge("tide_scheduler_new_samples_threshold",
                        "New samples needed to launch a retrain")
SCHED_RUNNING = Gauge("tide_scheduler_retrain_running", "1 while a retrain job is running")
SCHED_CONSECUTIVE_FAILURES = Gauge("tide_scheduler_consecutive_failures",
                                   "Failed or timed-out retrains since the last success")
SCHED_LAST_SUCCESS = Gauge("tide_scheduler_last_success_timestamp_seconds",
                           "Unix time the last successful retrain finished (0 = never)")
SCHED_SECONDS_SINCE_SUCCESS = Gauge(
    "tide_scheduler_seconds_since_last_success",
    "Seconds since the last successful retrain finished (since scheduler start if never)")
SCHED_TICKS = Counter("tide_scheduler_ticks_total", "Policy evaluations, by decision",
                      ["decision"])  # launch | running | cooldown | backoff | not_enough | error
SCHED_SHIFTS = Counter("tide_scheduler_shifts_detected_total", "Workload shifts detected, by the signal that saw "
                       "it (workload_mix: the captured workload mix; acceptance_drop: the serving drafter's live "
                       "acceptance)", ["signal"])
SCHED_LAST_SHIFT = Gauge("tide_scheduler_last_shift_timestamp_seconds",
                         "Unix time the last workload shift was detected (0 = none)")
SCHED_SECONDS_SINCE_SHIFT = Gauge("tide_scheduler_seconds_since_shift",
                                  "Seconds since the last workload shift was detected (-1 = none)")
SCHED_SHIFT_INFO = Gauge(
    "tide_scheduler_shift_info", "1 for the last detected workload shift: the signal, the workloads that grew, the "
    "retrain it triggered (empty until launched) and that retrain's state (pending | running | its outcome)",
    ["signal", "workloads", "retrain_job", "retrain_state"])
SCHED_WORKLOAD_SHARE = Gauge("tide_scheduler_workload_token_share",
                             "Share of the newest captured tokens by workload tag (the mix the shift signal reads)",
                             ["workload"])

# --- drafter service (tide/drafting/server.py, tide/services/drafter.py) -------------------------
DRAFTER_SERVICE_INFO = Gauge("tide_drafter_service_drafter_info", "1 for the drafter version the service serves",
                             ["drafter_version"])
DRAFTER_SERVICE_REQUESTS = Counter(
    "tide_drafter_service_requests_total", "Draft requests by outcome (drafted; superseded: the engine sent a newer "
    "one before this was drafted; unknown_engine; invalid)", ["outcome"])
DRAFTER_SERVICE_BATCH_ROWS = Histogram("tide_drafter_service_batch_rows", "Rows drafted in one batch (all engines)",
                                       buckets=(1, 2, 4, 8, 16, 32, 64))
DRAFTER_SERVICE_DRAFT_SECONDS = Histogram(
    "tide_drafter_service_draft_seconds", "Seconds drafting one batch",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32))
DRAFTER_SERVICE_QUEUE_SECONDS = Histogram(
    "tide_drafter_service_queue_seconds", "From a draft request's arrival to its batch",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16))
DRAFTER_SERVICE_UTILISATION = Gauge("tide_drafter_service_utilisation",
                                    "Fraction of the last seconds the service spent drafting")
DRAFTER_SERVICE_SESSIONS = Gauge("tide_drafter_service_sessions", "Sessions (engine, request) held")
DRAFTER_SERVICE_ENGINES = Gauge("tide_drafter_service_engines", "Engines connected (said hello)")
DRAFTER_SERVICE_EVICTED = Gauge("tide_drafter_service_sessions_evicted",
                                "Sessions freed to make room since start (drafter_service.max_sessions)")

# --- ops (swap watcher, collapse guard, promote/rollback) --------------------------------------
OPS_SWAPS = Counter("tide_ops_swap_checks_total", "Champion checks by outcome (swapped/refused/not_applied/error)",
                    ["outcome"])
OPS_ROLLBACKS = Counter("tide_ops_rollbacks_total", "Rollbacks by cause (operator/collapse)", ["cause"])
OPS_COLLAPSE_ALERT = Gauge("tide_ops_collapse_alert", "1 while the collapse guard has fired for the serving drafter")
OPS_LIVE_ACCEPT = Gauge("tide_ops_live_accept_length_tokens",
                        "Mean tokens per target forward over the guard's last window", ["drafter_version"])
OPS_REGISTRY_CONNECTED = Gauge("tide_ops_registry_connected",
                               "1 while the engine's drafter follower last reached the registry")
OPS_FOLLOWED_REFUSED = Gauge("tide_ops_followed_version_refused",
                             "1 while the followed alias points at a version this engine refused "
                             "(it keeps serving the drafter it had)")
OPS_CONVERGED = Gauge("tide_ops_converged",
                      "1 while the engine serves the version its followed alias names (rollout done here)")
OPS_SERVING_SINCE = Gauge("tide_ops_serving_since_timestamp_seconds",
                          "Unix time the serving drafter version started serving")
OPS_ALIAS_OPERATIONS = Counter("tide_ops_alias_operations_total",
                               "Alias operations by the alias owner (promote/rollback/auto-promote/collapse), "
                               "by outcome (applied/not_applied/conflict)", ["op", "outcome"])
OPS_ALIAS_GENERATION = Gauge("tide_ops_alias_generation", "The alias ledger's generation the owner last applied")
OPS_OPERATIONS = Counter("tide_ops_operations_total",
                         "Drafter control API calls (list/promote/rollback/operations), by outcome",
                         ["op", "outcome"])
