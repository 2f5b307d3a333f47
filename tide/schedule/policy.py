"""When to launch a retrain: pure functions over the state, the dataset table's log and the clock.

A retrain launches when all hold, checked in this order (the first that fails is the reason):
1. no retrain is running (single flight);
2. the backoff after the last failure has passed: ``min(backoff_max_s, backoff_base_s * 2**(n-1))``
   after the n-th consecutive failure, so a broken job is retried ever more slowly but never
   blocks for good, and one success resets the streak;
3. the cool-down after the last successful retrain has passed;
4. at least ``min_new_samples`` samples arrived since the last successful retrain.
After a detected workload shift (``tide/schedule/shift.py``) whose retrain has not launched yet,
3 is waived and 4 asks ``shift_min_new_samples`` of the new traffic: with
``shift_window_from_shift``, only commits made since the new traffic began count
(``shift_samples_since_s``), so the shift's retrain launches when its own window holds that much,
however long ago the last retrain was. The service runs on a mismatched drafter for as little time
as it takes to gather it (the launch carries ``shift_env``: a shorter warm-started run on what came
since the shift, with the older traffic as replay).

"Arrived since" means committed to the table after the watermark, a table version: the counts
are the ``tide.counts`` metadata ingest records in each commit (read from the log, never by
listing or opening data files), so late data still counts and no clock has to agree with
another (a shift's count compares commit times with the capture time where the new traffic
began: clocks that agree to within an ingest batch's seconds, as NTP keeps them). A successful
retrain moves the watermark to the table version it reports to have read
(``watermark_after_success``), not to the newest at its launch: commits made while it started up
were trained on and are not new again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tide.config import CHOICES, TrainConfig
from tide.contracts import RESULT_DATA_WATERMARK
from tide.schedule.state import SchedulerState

SAMPLE_UNITS = CHOICES["schedule.sample_unit"]


@dataclass(frozen=True)
class Decision:
    launch: bool
    reason: str  # launch | running | backoff | cooldown | not_enough
    new_samples: int
    wait_s: float = 0.0  # for backoff/cooldown: seconds until that gate opens
    threshold: int = 0  # the new samples this decision asked for
    shift: bool = False  # the retrain of a detected workload shift (launched or waited for)


def check_config(cfg: Any) -> None:
    """Reject a ScheduleConfig the policy cannot run with for what no rule on its fields covers (those
    are checked when it is read): a ``shift_train`` key that is no train.* setting, naming it."""
    shift_env(cfg, None)  # a shift_train key that is no train.* setting fails now, not at the first shift


def backoff_delay_s(failures: int, base_s: float, max_s: float) -> float:
    if failures <= 0:
        return 0.0
    # exponent capped so the float stays finite however long the streak
    return min(max_s, base_s * 2.0 ** min(failures - 1, 60))


def decide(state: SchedulerState, new_samples: int, now_s: float, cfg: Any) -> Decision:
    """``cfg`` is the ScheduleConfig."""
    shift = state.shift is not None and state.shift.pending
    threshold = cfg.shift_min_new_samples if shift else cfg.min_new_samples
    if state.running is not None:
        return Decision(False, "running", new_samples, threshold=threshold, shift=shift)
    if state.consecutive_failures > 0 and state.last_failure_at_s is not None:
        ready_s = state.last_failure_at_s + backoff_delay_s(
            state.consecutive_failures, cfg.backoff_base_s, cfg.backoff_max_s)
        if now_s < ready_s:
            return Decision(False, "backoff", new_samples, ready_s - now_s, threshold, shift)
    if state.last_success is not None and not shift:
        ready_s = state.last_success.finished_at_s + cfg.cooldown_s
        if now_s < ready_s:
            return Decision(False, "cooldown", new_samples, ready_s - now_s, threshold, shift)
    if new_samples < threshold:
        return Decision(False, "not_enough", new_samples, threshold=threshold, shift=shift)
    return Decision(True, "launch", new_samples, threshold=threshold, shift=shift)


def shift_env(cfg: Any, shift: Any) -> dict[str, str]:
    """The environment of a shift's retrain: ``shift_train`` as ``TIDE_TRAIN__*`` overrides, ``train.patch``
    (unless ``shift_train`` sets it) and, with
    ``shift_window_from_shift``, a window starting where the new traffic began (``shift``: the
    ShiftRecord; None only checks the keys). Raises ValueError naming a key that is no train.* setting."""
    unknown = sorted(set(cfg.shift_train) - set(TrainConfig.model_fields))
    if unknown:
        raise ValueError(f"config.schedule.shift_train: {unknown} are not train.* settings")
    env = {f"TIDE_TRAIN__{key.upper()}": str(value) for key, value in cfg.shift_train.items()}
    if shift is not None:  # registered as a patch: the next full retrain warm-starts past it
        env.setdefault("TIDE_TRAIN__PATCH", "true")
    if shift is not None and cfg.shift_window_from_shift and shift.since_s is not None:
        env["TIDE_TRAIN__WINDOW_SINCE_S"] = f"{shift.since_s:.3f}"
    return env


def watermark_of(state: SchedulerState) -> int | None:
    """Table versions after this were not yet read by a successful retrain (None = all of them)."""
    return state.last_success.watermark_version if state.last_success is not None else None


def watermark_after_success(previous: int | None, launched: int | None,
                            result: Mapping[str, Any]) -> int | None:
    """The watermark after a successful retrain: the table version it reports to have read, never
    below ``previous``; a job that reports none keeps the version newest at its launch."""
    read = result.get(RESULT_DATA_WATERMARK)
    if isinstance(read, bool) or not isinstance(read, int) or read < 0:
        return launched
    return read if previous is None else max(previous, read)


def count_new_samples(table: Any, watermark: int | None, unit: str, target_model: str = "",
                      committed_since_s: float | None = None) -> int:
    """Samples committed after table version ``watermark`` (and, with ``committed_since_s``, at or
    after that unix time), from the commits' metadata (the log)."""
    if unit not in SAMPLE_UNITS:
        raise ValueError(f"schedule.sample_unit: {unit!r} is not one of {SAMPLE_UNITS}")
    return int(table.counts_since(watermark, target_model or None, committed_since_s=committed_since_s)[unit])


def shift_samples_since_s(cfg: Any, state: SchedulerState) -> float | None:
    """Where the pending shift's count of new samples starts: where its new traffic began, when its
    retrain's window starts there (``shift_window_from_shift``); None: the watermark alone."""
    shift = state.shift
    if shift is None or not shift.pending or not cfg.shift_window_from_shift:
        return None
    return shift.since_s


def newest_version(table: Any, watermark: int | None) -> int | None:
    """The watermark a retrain launched now would advance to if it reported none: the newest version."""
    newest = table.version()
    return watermark if newest is None else newest
