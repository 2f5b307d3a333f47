"""The reference engine's counters: EngineStats for callers and the Prometheus series, kept together.

The decode thread writes, any thread reads ``stats()``; the lock is never held across a step.
A drafter's acceptance counts only the rows whose drafts were verified: a row the scheduler or the
gate ran target-only says nothing about the drafter, nor does a row of a drafted step that kept no
draft (its workload gated off beside one that drafts, or the cost plan truncating every draft after
a peek): counted, such rows would pull the reading toward 1 by how the step was scheduled, not by
what the drafter proposes. The swap guard and the dashboards judge a drafter by this; a probe
step's rows (a gated-off workload made to verify a draft, tide/spec/policy.py) are counted like any
drafted row, which is what keeps the guard judging a drafter whose speculation is off.
"""
from __future__ import annotations

import threading

from tide import metrics
from tide.engine.base import EngineStats, VersionAcceptance
from tide.spec.decode import RowResult, StepStats


class EngineAccounting:
    """Per-step and per-request bookkeeping of one engine."""

    def __init__(self):
        self._stats = EngineStats()
        self._lock = threading.Lock()

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats.copy()

    def step(self, version: str, results: list[RowResult], stats: StepStats | None, has_drafter: bool) -> None:
        """One decode step's rows; ``stats`` is None for a target-only step. With no drafter serving,
        every row counts (its acceptance is the target-only baseline, 1 token per forward)."""
        if not has_drafter:
            judged = results
        else:
            judged = [] if stats is None else [r for r, n in zip(results, stats.drafted) if n > 0]
        counted = VersionAcceptance(len(judged), sum(r.n_accepted for r in judged),
                                    sum(len(r.committed) for r in judged))
        with self._lock:
            st = self._stats
            st.target_forwards += len(results)
            st.acceptance[version] = st.acceptance.get(version, VersionAcceptance()) + counted
        metrics.ENGINE_TARGET_FORWARDS.labels(version).inc(len(results))
        for res in judged:
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
