"""Phase 2's stop rule of ``tide demo`` (``LoopWatch``), and the two readings of the running stack
it follows: the drafter version the engine serves (``serving_version``) and how many retrains the
scheduler has launched and finished (``retrain_counts``). tide/demo.py runs the phases and writes the report.
"""
from __future__ import annotations

import threading
import time
from typing import Protocol

import httpx

from tide import prometheus
from tide.comparison import say
from tide.metrics import SCHED_RETRAINS_FINISHED, SCHED_RETRAINS_LAUNCHED, SCHED_RETRAINS_NOTHING_TO_DO
from tide.stack import Stack
from tide.traffic import AcceptanceSampler, loop_status, metric_value, scrape


def serving_version(engine_url: str) -> str:
    return httpx.get(f"{engine_url}/health", timeout=5).json().get("drafter_version", "?")


def retrain_counts(stack: Stack) -> tuple[float, float]:
    """(launched, judged) retrains as the scheduler counts them: judged ones finished with a candidate
    or a failure. One that found too little data (``nothing_to_do``) registered nothing to promote, and
    the scheduler launches another once more has arrived: the loop is still open, not refused."""
    text = scrape(stack.endpoints["scheduler metrics"])
    finished = metric_value(text, SCHED_RETRAINS_FINISHED) or 0.0
    empty = metric_value(text, SCHED_RETRAINS_NOTHING_TO_DO) or 0.0
    return (metric_value(text, SCHED_RETRAINS_LAUNCHED) or 0.0) - empty, finished - empty


def retrains_finished(stack: Stack) -> float:
    return retrain_counts(stack)[1]


class WatchBounds(Protocol):
    """What LoopWatch reads of the demo's settings (tide.demo.DemoSettings, which imports this module)."""

    @property
    def after_requests(self) -> int: ...
    @property
    def after_min_forwards(self) -> int: ...
    @property
    def after_min_drafted_forwards(self) -> int: ...
    @property
    def swap_timeout_s(self) -> float: ...
    @property
    def after_timeout_s(self) -> float: ...
    @property
    def not_promoted_grace_s(self) -> float: ...
    @property
    def max_unpromoted_retrains(self) -> int: ...
    @property
    def final_timeout_s(self) -> float: ...


class LoopWatch:
    """Phase 2's stop rule. Traffic goes on until the loop has shown what it must: the engine
    swapped to a retrained drafter (the first swap: the shift's quick retrain); with
    ``final_timeout_s``, a retrain launched after it finished and its drafter swapped in (or was
    not promoted within ``not_promoted_grace_s``); then the drafter serving served
    ``after_requests`` requests and ``after_min_forwards`` target forwards
    (``after_min_drafted_forwards`` of them on rows it drafted), and the stack's Prometheus has
    recorded its acceptance (the dashboard's series). Each wait is bounded; past a bound
    ``reason`` says which event did not come and where the loop stood."""

    CHECK_EVERY_S = 2.0  # done() runs before every request; the scrapes behind it need not

    def __init__(self, stack: Stack, sampler: AcceptanceSampler, static_version: str,
                 settings: WatchBounds, t_shift: float):
        self.stack, self.sampler, self.settings, self.t_shift = stack, sampler, settings, t_shift
        self.static_version = self.version = static_version
        self.swaps: list[tuple[float, str]] = []
        self.t_swap: float | None = None
        self.t_first_swap: float | None = None
        # retrains launched when the first swap came: the swap is the retrain's own auto-promotion,
        # seen before the scheduler reaps that job and counts it finished, so a count of finished
        # ones taken then misses it; retrains run one at a time, so the final one (launched after
        # the swap) has finished once more have finished than had been launched by then
        self.launched_at_first_swap = 0.0
        self.final_note: str | None = None  # how the wait for the final drafter ended
        self.t_closed: float | None = None
        self.served_after = 0
        self.closed = False
        self.reason: str | None = None
        self._lock = threading.Lock()
        self._next_check = 0.0
        self._finished_at: float | None = None

    def on_done(self, *_) -> str:
        """After each request: follow the engine's serving version; returns it."""
        version = serving_version(self.stack.endpoints["engine"])
        if version == "mixed":  # engines disagree while a rollout is under way: not swapped yet
            version = self.version
        with self._lock:
            if self.closed or self.reason is not None:  # the outcome stands: requests still in flight
                return version  # finish, and a swap among them is not the one the loop judged
            if version != self.version:
                self.swaps.append((time.monotonic() - self.sampler.t0, version))
                self.sampler.mark(f"swap to v{version}")
                say(f"engine now serves drafter {version}")
                self.version, self.t_swap, self.served_after = version, time.monotonic(), 0
                if self.t_first_swap is None:
                    self.t_first_swap, self.launched_at_first_swap = self.t_swap, retrain_counts(self.stack)[0]
            if version != self.static_version:
                self.served_after += 1
        return version

    def done(self) -> bool:
        with self._lock:
            if self.closed or self.reason is not None:
                return True
            now = time.monotonic()
            if now < self._next_check:
                return False
            self._next_check = now + self.CHECK_EVERY_S
            if self.t_swap is None:
                self.reason = self._no_swap_reason(now)
            else:
                self._check_after_swap(now)
            return self.closed or self.reason is not None

    def _no_swap_reason(self, now: float) -> str | None:
        s = self.settings
        if now - self.t_shift > s.swap_timeout_s:
            return (f"no swap within {s.swap_timeout_s:.0f} s of the shift ("
                    + loop_status(self.stack.endpoints["ingest metrics"], self.stack.endpoints["scheduler metrics"])
                    + ")")
        finished = retrains_finished(self.stack)
        if finished >= s.max_unpromoted_retrains:
            self._finished_at = self._finished_at or now
            if now - self._finished_at > s.not_promoted_grace_s:
                return (f"{finished:.0f} retrains finished but no challenger was promoted "
                        "(held-out metrics: registry_versions)")
        return None

    def _check_after_swap(self, now: float) -> None:
        if not self._final_done(now):
            if now - self.t_first_swap > self.settings.final_timeout_s:
                self.reason = (f"{self.settings.final_timeout_s:.0f} s after the first swap, no later retrain "
                               "finished and swapped in (" + loop_status(self.stack.endpoints["ingest metrics"],
                                                                         self.stack.endpoints["scheduler metrics"]) + ")")
            return
        missing = self.missing()
        if not missing:
            self.closed, self.t_closed = True, now
        elif now - self.t_swap > self.settings.after_timeout_s:
            self.reason = (f"{self.settings.after_timeout_s:.0f} s after the swap to drafter {self.version}, "
                           "still missing: " + "; ".join(missing))

    def _final_done(self, now: float) -> bool:
        """The final drafter serves: a retrain launched after the first swap finished, and its drafter
        swapped in or was not promoted within the grace (``final_timeout_s`` 0: the first swap is final)."""
        if self.settings.final_timeout_s <= 0 or self.final_note is not None:
            return True
        if len(self.swaps) > 1:
            self.final_note = f"the retrain after the first swap swapped in drafter {self.version}"
            return True
        if retrains_finished(self.stack) <= self.launched_at_first_swap:
            return False
        self._finished_at = self._finished_at or now
        if now - self._finished_at > self.settings.not_promoted_grace_s:
            self.final_note = "the retrain after the first swap finished without a promoted challenger"
            return True
        return False

    def missing(self) -> list[str]:
        """What the adapted drafter has not shown yet (empty: the loop closed)."""
        s, out = self.settings, []
        if self.served_after < s.after_requests:
            out.append(f"{s.after_requests} requests served by it ({self.served_after} so far)")
        since_s = self.t_swap - self.sampler.t0
        served = self.sampler.served_forwards_since(since_s, self.version)
        if served < s.after_min_forwards:
            out.append(f"{s.after_min_forwards} live target forwards ({served:.0f} so far)")
        drafted = self.sampler.forwards_since(since_s, self.version)
        if drafted < s.after_min_drafted_forwards:
            out.append(f"{s.after_min_drafted_forwards} live target forwards of drafted rows ({drafted:.0f} so far)")
        base = self.stack.endpoints.get("prometheus")
        if base is not None and not prometheus.has_accept_sample(base, self.version):
            out.append(f"a dashboard sample of {prometheus.ACCEPT_SERIES} for it")
        return out

    def evidence(self) -> str:
        return (f"drafter {self.version} served {self.served_after} requests in "
                f"{self.t_closed - self.t_swap:.0f} s after the swap, with its dashboard series recorded")

    def outcome(self) -> dict:
        first = round(self.t_first_swap - self.t_shift, 1) if self.t_first_swap else None
        return {"closed": self.closed, "reason": self.reason, "served_after_swap": self.served_after,
                "post_swap_s": round((self.t_closed or time.monotonic()) - self.t_swap, 1) if self.t_swap else None,
                "shift_to_swap_s": round(self.t_swap - self.t_shift, 1) if self.t_swap else None,
                "shift_to_first_swap_s": first, "swaps": len(self.swaps), "final": self.final_note}
