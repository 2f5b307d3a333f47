"""How ingest waits out a write it could not make (a full disk, a failing disk, an unreachable
dead-letter topic): it stops consuming, waits, then tries again, doubling the wait while it fails.

States: writing (no failure) -> blocked (consumption paused until ``retry_at_s``) -> retrying
(consuming again; the next seal decides) -> writing on success, or blocked again for twice as
long (up to ``max_s``) on failure. Failures while already blocked belong to the same episode:
they rewind their partition but do not lengthen the wait. The reason (``disk_full`` for ENOSPC,
EDQUOT, else ``write_error``: an unreachable object store, ...) is what ``/health`` and the
``tide_ingest_write_blocked`` gauge report.
"""
from __future__ import annotations

import errno
import logging

from tide import metrics

log = logging.getLogger(__name__)

DISK_FULL = "disk_full"
WRITE_ERROR = "write_error"
REASONS = (DISK_FULL, WRITE_ERROR)
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def failure_reason(exc: BaseException) -> str:
    """``disk_full`` when ``exc`` or an exception it was raised from is a full disk or quota."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return DISK_FULL
        exc = exc.__cause__ or exc.__context__
    return WRITE_ERROR


class WriteBackoff:
    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.failures = 0  # consecutive episodes (reset by a successful write)
        self.delay_s = 0.0
        self.retry_at_s = 0.0  # monotonic
        self.reason = ""
        self.blocked = False  # consumption paused, waiting for retry_at_s
        for reason in REASONS:
            metrics.INGEST_WRITE_BLOCKED.labels(reason).set(0)
        metrics.INGEST_WRITE_BACKOFF_SECONDS.set(0)

    @property
    def failing(self) -> bool:
        """From a failed write until one succeeds (blocked or retrying)."""
        return self.failures > 0

    def failed(self, exc: BaseException, now_s: float) -> None:
        reason = failure_reason(exc)
        metrics.INGEST_WRITE_FAILURES.labels(reason).inc()
        if self.blocked:
            return  # same episode: the wait already runs
        self.failures += 1
        self.delay_s = min(self.max_s, self.initial_s * 2 ** (self.failures - 1))
        self.retry_at_s = now_s + self.delay_s
        self.blocked = True
        self._set_reason(reason)
        metrics.INGEST_WRITE_BACKOFF_SECONDS.set(self.delay_s)
        log.error("ingest: cannot write (%s: %s); consuming nothing for %.1f s (failure %d)",
                  reason, exc, self.delay_s, self.failures)

    def due(self, now_s: float) -> bool:
        return self.blocked and now_s >= self.retry_at_s

    def retrying(self) -> None:
        """Consumption resumed; the next seal tells whether writing works again."""
        self.blocked = False

    def succeeded(self) -> None:
        if self.failures and not self.blocked:
            log.info("ingest: writing again after %d failed attempts", self.failures)
            self.failures, self.delay_s = 0, 0.0
            self._set_reason("")
            metrics.INGEST_WRITE_BACKOFF_SECONDS.set(0)

    def _set_reason(self, reason: str) -> None:
        self.reason = reason
        for name in REASONS:
            metrics.INGEST_WRITE_BLOCKED.labels(name).set(1 if name == reason else 0)

    def details(self, now_s: float) -> dict:
        """What /health shows while failing (no exception text: that goes to the log)."""
        return {"state": self.reason, "write_failures": self.failures, "backoff_s": self.delay_s,
                "retry_in_s": round(max(0.0, self.retry_at_s - now_s), 1) if self.blocked else 0.0}
