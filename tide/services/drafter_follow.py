"""The drafter service's follower: ``champion`` followed once for every engine the service drafts
for, and a collapse guard per engine.

It is the engine's follower (tide/ops/follower.py: registry thread, swap watcher, fleet report,
collapse report to the alias owner) over the service's ``DrafterHost`` instead of an engine. Only
the guard thread differs: each engine that reports acceptance gets its own ``CollapseGuard``
judging that engine's windows (engines serve different traffic: one collapsing is enough). A
collapse judged on any engine swaps the previous drafter back for all (the service serves one
drafter), refuses the collapsed version and reports it to the alias owner, as an engine's guard does.
"""
from __future__ import annotations

import logging
import socket

from tide.engine.base import EngineStats
from tide.ops.alias_api import alias_writer
from tide.ops.follower import DrafterFollower
from tide.ops.guard import CollapseGuard
from tide.registry import Registry

log = logging.getLogger(__name__)


class EngineView:
    """What a collapse guard reads of one engine: the served version and that engine's counters."""

    def __init__(self, server, engine: str) -> None:
        self.server, self.engine = server, engine

    @property
    def drafter_version(self) -> str:
        return self.server.host.drafter_version

    def stats(self) -> EngineStats:
        return EngineStats(acceptance=self.server.acceptance_of(self.engine))


class ServiceFollower(DrafterFollower):
    def __init__(self, server, cfg, *args, **kwargs) -> None:
        super().__init__(server.host, cfg, *args, **kwargs)
        self.server = server
        self.guards: dict[str, CollapseGuard] = {}

    @classmethod
    def from_config(cls, server, cfg) -> "ServiceFollower":
        from tide.drafter.static import static_drafter_path

        path = static_drafter_path(cfg) if cfg.drafter.path == "static" else None
        dcfg = cfg.drafter_service
        return cls(server, cfg.ops, lambda: Registry.from_config(cfg), path, None,
                   writer=lambda registry: alias_writer(cfg, registry),
                   replica=f"drafter-service@{socket.gethostname()}:{dcfg.port}")

    def _guard_loop(self) -> None:
        while not self._stop.wait(self.cfg.guard_interval_s):
            try:
                self.check_engines()
            except Exception:  # noqa: BLE001 - the guard thread outlives a bug in one check
                log.exception("drafter service: collapse guard step failed; continuing")

    def check_engines(self) -> str | None:
        """One guard check per engine that reported acceptance; the first collapse's reason."""
        cfg = self.cfg
        for engine in self.server.reporting_engines():
            guard = self.guards.get(engine)
            if guard is None:
                guard = self.guards[engine] = CollapseGuard(EngineView(self.server, engine), self._guard_rollback,
                                                            cfg.guard_floor, cfg.guard_min_ratio,
                                                            cfg.guard_window_forwards)
            with self._swap_lock:
                reason = guard.check()
            if reason is not None:
                log.error("drafter service: engine %s judged drafter %s collapsed", engine, guard.engine.drafter_version)
                return reason
        return None
