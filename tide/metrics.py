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
ENGINE_ACCEPT_LENGTH = Histogram(
    "tide_engine_accept_length_tokens", "Tokens committed per target forward (accepted + bonus)",
    ["drafter_version"], buckets=(1, 2, 3, 4, 5, 6, 7, 8, 9))
ENGINE_STEP_SECONDS = Histogram(
    "tide_engine_step_seconds", "Wall time of one batched decode step",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2))
ENGINE_BATCH_SIZE = Gauge("tide_engine_batch_size", "Requests in the running batch")
ENGINE_QUEUE_DEPTH = Gauge("tide_engine_queue_depth", "Requests waiting to be admitted")
ENGINE_DRAFTER_INFO = Gauge("tide_engine_drafter_info", "1 for the drafter version now serving",
                            ["drafter_version"])
