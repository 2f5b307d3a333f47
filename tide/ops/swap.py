"""Swap watcher: the engine follows the registry's ``champion`` alias.

``check_now`` (called every ``poll_interval_s`` and by the authenticated control endpoint):
1. resolve the champion: (version, local folder) from the registry; nothing to do if the engine
   already serves it, or if this exact version was refused before;
2. ``engine.validate_drafter``: checksum, config, shapes and aux layers against the target, the
   vocab mapping against the serving one, and a smoke decode of a short prompt whose greedy
   output must equal target-only output (a drafter that raises, or breaks losslessness, never
   reaches traffic);
3. ``engine.swap_drafter`` under ``swap_lock``: applied atomically between decode steps; the
   previous drafter object is kept so a rollback is immediate. Resolving and validating happen
   outside that lock, so the collapse guard (which swaps under the same lock) never waits on the
   registry or on a smoke decode; a version the guard refused meanwhile is not swapped in.
Anything a candidate raises while validated refuses that version (it is never retried, and the
registry is not blamed): the old drafter keeps serving, and the refusal is logged once and counted
(``tide_ops_swap_checks_total{outcome="refused"}``).
A swap the engine has not applied ``apply_timeout_s`` after it was asked (a stalled decode loop, a
swap the engine could not allocate) is ``not_applied``, counted under that outcome: ``previous`` stays
what it was and the version is not refused, so the next check asks again; if the engine applies the
asked swap later, that check reports it ``swapped`` and records ``previous`` then.
The registry is reached only through the ``resolve`` callable, so this module has no MLflow code,
and the engine only through its contract (tide/engine/base.py), so it works for any engine.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tide import metrics
from tide.drafter.artifact import DrafterError
from tide.engine.base import Engine

log = logging.getLogger(__name__)

Resolver = Callable[[], "tuple[str, Path] | None"]


@dataclass(frozen=True)
class SwapOutcome:
    status: str  # "swapped" | "unchanged" | "refused" | "not_applied" | "error"
    version: str | None
    detail: str = ""
    pause_s: float = 0.0


class SwapWatcher:
    def __init__(self, engine: Engine, resolve: Resolver, smoke_prompt_ids: list[int],
                 poll_interval_s: float = 10.0, swap_lock: threading.RLock | None = None,
                 apply_timeout_s: float = 30.0):
        self.engine = engine
        self.resolve = resolve
        self.smoke_prompt_ids = list(smoke_prompt_ids)
        self.poll_interval_s = poll_interval_s
        self.apply_timeout_s = apply_timeout_s  # a swap not served by then is reported not applied
        self.refused: dict[str, str] = {}  # version -> reason (not retried)
        self.previous: tuple[str, Any] | None = None  # (version, drafter handle) served before the last swap
        self.serving_since_s = time.time()  # when the serving version started serving (its swap)
        # (asked version, (version, handle) serving when asked) of the last swap not applied in time
        self._unapplied: tuple[str, tuple[str, Any]] | None = None
        self._lock = threading.Lock()  # one check at a time (poll loop vs control endpoint)
        # what serves and what is refused changes only under this lock, held for a swap at most
        self.swap_lock = swap_lock or threading.RLock()

    def check_now(self) -> SwapOutcome:
        with self._lock:
            try:
                return self._check()
            except Exception as exc:  # registry down etc.: keep serving, count it
                log.warning("drafter check failed: %s", exc)
                metrics.OPS_SWAPS.labels("error").inc()
                return SwapOutcome("error", None, str(exc))

    def _check(self) -> SwapOutcome:
        resolved = self.resolve()
        if resolved is None:
            return SwapOutcome("unchanged", self.engine.drafter_version, "no champion")
        version, folder = resolved
        if version == self.engine.drafter_version:
            return self._applied_late(version) or SwapOutcome("unchanged", version)
        if version in self.refused:
            return SwapOutcome("refused", version, self.refused[version])
        try:
            drafter = self.validate(folder)
        except Exception as exc:  # noqa: BLE001 - a bad artifact is the version's fault, whatever it raises
            reason = str(exc) if isinstance(exc, DrafterError) else f"{type(exc).__name__}: {exc}"
            self.refuse(version, reason)
            return SwapOutcome("refused", version, reason)
        with self.swap_lock:
            if version in self.refused:  # the collapse guard refused it while it was validated
                return SwapOutcome("refused", version, self.refused[version])
            return self.swap_to(version, drafter)

    def refuse(self, version: str, reason: str) -> None:
        """Never serve ``version`` again in this process; logged and counted once."""
        with self.swap_lock:
            if version in self.refused:
                return
            self.refused[version] = reason
        metrics.OPS_SWAPS.labels("refused").inc()
        log.error("refusing drafter version %s: %s", version, reason)

    def validate(self, folder: Path) -> Any:
        return self.engine.validate_drafter(folder, self.smoke_prompt_ids)

    def swap_to(self, version: str, drafter: Any) -> SwapOutcome:
        with self.swap_lock:
            old_version, old = self.engine.drafter_version, self.engine.drafter
            t0 = time.perf_counter()
            self.engine.swap_drafter(drafter, version)
            if not self._wait_applied(version):
                return self._not_applied(version, (old_version, old), time.perf_counter() - t0)
            self.previous, self._unapplied = (old_version, old), None
            self.serving_since_s = time.time()
        metrics.OPS_SWAPS.labels("swapped").inc()
        log.info("serving drafter %s (was %s)", version, old_version)
        return SwapOutcome("swapped", version, f"from {old_version}", time.perf_counter() - t0)

    def _not_applied(self, version: str, was: tuple[str, Any], waited_s: float) -> SwapOutcome:
        """The engine still serves another version: nothing is recorded as swapped; asked again next check."""
        self._unapplied = (version, was)
        served = self.engine.drafter_version
        detail = f"engine still serves {served} {waited_s:.1f} s after the swap to {version} was asked"
        metrics.OPS_SWAPS.labels("not_applied").inc()
        log.error("drafter %s not applied: %s", version, detail)
        return SwapOutcome("not_applied", version, detail, waited_s)

    def _applied_late(self, version: str) -> SwapOutcome | None:
        """The engine now serves a swap it had not applied when asked: record it as that swap."""
        with self.swap_lock:
            unapplied = self._unapplied
            if unapplied is None or unapplied[0] != version or self.engine.drafter_version != version:
                return None
            self.previous, self._unapplied = unapplied[1], None
            self.serving_since_s = time.time()
        metrics.OPS_SWAPS.labels("swapped").inc()
        log.info("serving drafter %s (was %s; applied after the wait)", version, unapplied[1][0])
        return SwapOutcome("swapped", version, f"from {unapplied[1][0]} (applied after the wait)")

    def _wait_applied(self, version: str) -> bool:
        """True once the engine serves ``version``; False after ``apply_timeout_s``."""
        deadline = time.monotonic() + self.apply_timeout_s
        while self.engine.drafter_version != version:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.poll_interval_s):
            self.check_now()

