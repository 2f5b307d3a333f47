"""When to launch a retrain: pure functions over the state, the dataset index and the clock.

A retrain launches when all hold, checked in this order (the first that fails is the reason):
1. no retrain is running (single flight);
2. the backoff after the last failure has passed: ``min(backoff_max_s, backoff_base_s * 2**(n-1))``
   after the n-th consecutive failure, so a broken job is retried ever more slowly but never
   blocks for good, and one success resets the streak;
3. the cool-down after the last successful retrain has passed;
4. at least ``min_new_samples`` samples arrived since the last successful retrain.

"Arrived since" uses the index's ``created_at_s`` (when ingest made the file durable), not the
capture time: late data still counts, and the watermark comes from the index itself, so the
scheduler's clock never has to agree with ingest's. A successful retrain moves the watermark to
the newest ``created_at_s`` it reports to have read (``watermark_after_success``), not to the
newest at its launch: files sealed while it started up were trained on and are not new again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from tide.contracts import RESULT_DATA_WATERMARK
from tide.schedule.state import SchedulerState

SAMPLE_UNITS = ("tokens", "generated_tokens", "requests", "rows")


@dataclass(frozen=True)
class Decision:
    launch: bool
    reason: str  # launch | running | backoff | cooldown | not_enough
    new_samples: int
    wait_s: float = 0.0  # for backoff/cooldown: seconds until that gate opens


def check_config(cfg: Any) -> None:
    """Reject a ScheduleConfig the policy cannot run with, naming the field."""
    if cfg.sample_unit not in SAMPLE_UNITS:
        raise ValueError(f"schedule.sample_unit: {cfg.sample_unit!r} is not one of {SAMPLE_UNITS}")
    for name in ("interval_s", "job_timeout_s"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"schedule.{name} must be > 0, got {getattr(cfg, name)}")
    for name in ("min_new_samples", "cooldown_s", "kill_grace_s", "backoff_base_s",
                 "backoff_max_s"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"schedule.{name} must be >= 0, got {getattr(cfg, name)}")


def backoff_delay_s(failures: int, base_s: float, max_s: float) -> float:
    if failures <= 0:
        return 0.0
    # exponent capped so the float stays finite however long the streak
    return min(max_s, base_s * 2.0 ** min(failures - 1, 60))


def decide(state: SchedulerState, new_samples: int, now_s: float, cfg: Any) -> Decision:
    """``cfg`` is the ScheduleConfig."""
    if state.running is not None:
        return Decision(False, "running", new_samples)
    if state.consecutive_failures > 0 and state.last_failure_at_s is not None:
        ready_s = state.last_failure_at_s + backoff_delay_s(
            state.consecutive_failures, cfg.backoff_base_s, cfg.backoff_max_s)
        if now_s < ready_s:
            return Decision(False, "backoff", new_samples, ready_s - now_s)
    if state.last_success is not None:
        ready_s = state.last_success.finished_at_s + cfg.cooldown_s
        if now_s < ready_s:
            return Decision(False, "cooldown", new_samples, ready_s - now_s)
    if new_samples < cfg.min_new_samples:
        return Decision(False, "not_enough", new_samples)
    return Decision(True, "launch", new_samples)


def watermark_of(state: SchedulerState) -> float | None:
    """Files created after this were not yet seen by a successful retrain (None = all files)."""
    return state.last_success.watermark_s if state.last_success is not None else None


def watermark_after_success(previous_s: float | None, launched_s: float | None,
                            result: Mapping[str, Any]) -> float | None:
    """The watermark after a successful retrain: what it reports to have read, never below
    ``previous_s``; a job that reports nothing keeps the old rule (the newest file at launch)."""
    read_s = result.get(RESULT_DATA_WATERMARK)
    if isinstance(read_s, bool) or not isinstance(read_s, (int, float)) or not math.isfinite(read_s):
        return launched_s
    return float(read_s) if previous_s is None else max(previous_s, float(read_s))


def count_new_samples(index: Any, watermark_s: float | None, unit: str,
                      target_model: str = "") -> int:
    """Samples in files indexed after ``watermark_s``, from the index's totals (no file opened)."""
    if unit not in SAMPLE_UNITS:
        raise ValueError(f"schedule.sample_unit: {unit!r} is not one of {SAMPLE_UNITS}")
    summary = index.summary(created_after_s=watermark_s, target_model=target_model or None)
    return int(summary[unit] or 0)


def newest_created_s(index: Any, watermark_s: float | None, target_model: str = "") -> float | None:
    """The watermark a retrain launched now would advance to: the newest file's ``created_at_s``."""
    files = index.files(created_after_s=watermark_s, target_model=target_model or None)
    if not files:
        return watermark_s
    return max(f.created_at_s for f in files)
