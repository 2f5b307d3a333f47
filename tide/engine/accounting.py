"""The reference engine's counters: EngineStats for callers and the Prometheus series, kept together.

The decode thread writes, any thread reads ``stats()``; the lock is never held across a step.
A drafter's acceptance counts only the rows it drafted: a row the scheduler or the gate ran
target-only says nothing about the drafter, and the swap guard and the dashboards judge it by this.
"""
from __future__ import annotations

import threading

from tide import metrics
from tide.engine.base import EngineStats
from tide.spec.decode import RowResult, StepStats


class EngineAccounting:
    """Per-step and per-request bookkeeping of one engine."""

    def __init__(self):
        self._stats = EngineStats()
        self._lock = threading.Lock()

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats.copy()

    def step(self, version: str, results: list[RowResult], stats: StepStats | None, judged: bool) -> None:
        """One decode step's rows; ``judged``: the rows count towards ``version``'s acceptance."""
        with self._lock:
            st = self._stats
            st.target_forwards += len(results)
            acc = st.acceptance.setdefault(version, [0, 0, 0])
            for res in results if judged else ():
                acc[0] += 1
                acc[1] += res.n_accepted
                acc[2] += len(res.committed)
        metrics.ENGINE_TARGET_FORWARDS.labels(version).inc(len(results))
        for res in results if judged else ():
            metrics.ENGINE_ACCEPT_LENGTH.labels(version).observe(len(res.committed))
        if stats is not None:
            metrics.ENGINE_DRAFT_TOKENS.labels(version).inc(sum(stats.drafted) + stats.siblings * len(stats.drafted))
            metrics.ENGINE_ACCEPTED_TOKENS.labels(version).inc(sum(stats.accepted))
            metrics.ENGINE_SIBLING_ACCEPTS.labels(version).inc(stats.sibling_accepts)

    def tokens(self, version: str, n: int) -> None:
        with self._lock:
            self._stats.tokens_generated += n
        metrics.ENGINE_TOKENS.labels(version).inc(n)

    def outcome(self, outcome: str) -> None:
        """A request ended: ``ok``, ``error``, ``cancelled`` or another finish reason."""
        with self._lock:
            if outcome == "ok":
                self._stats.requests_finished += 1
            elif outcome == "error":
                self._stats.requests_failed += 1
        metrics.ENGINE_REQUESTS.labels(outcome).inc()
