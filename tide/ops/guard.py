"""Collapse guard: roll back a serving drafter whose live acceptance collapses.

A stale or wrongly swapped drafter drops acceptance to ~1 token per forward with no error
(sgl-project/sglang #31674). Each ``check``:
1. read the engine's cumulative per-version counters and take the delta since the last check;
   accumulate it into the serving version's current window;
2. once the window holds ``window_forwards`` target forwards, compare its mean tokens per
   forward with (a) the absolute ``floor`` and (b) ``min_ratio`` × the previous version's live
   mean (its baseline, measured before the swap);
3. on collapse: call ``rollback(reason)`` (swap back + move the registry alias), set the alert
   gauge, count it, and remember the version so it is not judged twice;
4. otherwise record the window mean as the version's baseline and start a new window.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from tide import metrics
from tide.contracts import VersionAcceptance

log = logging.getLogger(__name__)


@dataclass
class _Window:
    forwards: int = 0
    committed: int = 0

    @property
    def mean(self) -> float:
        return self.committed / self.forwards if self.forwards else 0.0


@dataclass
class CollapseGuard:
    engine: object
    rollback: Callable[[str], None]
    floor: float = 1.2
    min_ratio: float = 0.6
    window_forwards: int = 200
    baselines: dict[str, float] = field(default_factory=dict)
    _last: dict[str, VersionAcceptance] = field(default_factory=dict)
    _window: dict[str, _Window] = field(default_factory=dict)
    _judged_bad: set[str] = field(default_factory=set)
    _previous_version: str | None = None
    _serving: str | None = None

    def check(self) -> str | None:
        """Returns the rollback reason if it rolled back, else None."""
        version = self.engine.drafter_version
        if version != self._serving:
            self._previous_version, self._serving = self._serving, version
            metrics.OPS_COLLAPSE_ALERT.set(0)
        for v, counts in self.engine.stats().acceptance.items():
            delta = counts - self._last.get(v, VersionAcceptance())
            self._last[v] = counts
            w = self._window.setdefault(v, _Window())
            w.forwards += delta.forwards
            w.committed += delta.committed
        w = self._window.get(version)
        if w is None or w.forwards < self.window_forwards or version in self._judged_bad or version == "none":
            return None
        mean = w.mean
        self._window[version] = _Window()
        metrics.OPS_LIVE_ACCEPT.labels(version).set(mean)
        baseline = self.baselines.get(self._previous_version) if self._previous_version else None
        reason = None
        if mean < self.floor:
            reason = f"live acceptance {mean:.2f} tokens/forward below floor {self.floor:.2f}"
        elif baseline and mean < self.min_ratio * baseline:
            reason = (f"live acceptance {mean:.2f} < {self.min_ratio:.2f} x baseline {baseline:.2f} "
                      f"of previous version {self._previous_version}")
        if reason is None:
            self.baselines[version] = mean
            return None
        self._judged_bad.add(version)
        metrics.OPS_COLLAPSE_ALERT.set(1)
        metrics.OPS_ROLLBACKS.labels("collapse").inc()
        log.error("drafter %s collapsed: %s; rolling back", version, reason)
        self.rollback(f"collapse guard: drafter {version}: {reason}")
        return reason
