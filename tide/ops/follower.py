"""Drafter follower: the engine-side owner of the swap watcher, the collapse guard and the registry.

One background thread ("tide-ops") repeats until stopped:
1. while no registry is connected: try to connect every ``registry_retry_s`` (the engine keeps
   serving the drafter it has; inference never waits on the registry); on first contact,
   register the configured drafter as champion if the registry has no version yet;
2. every ``poll_interval_s``: ``check_now``: resolve the followed alias, download the version
   (checksum verified; a mismatch refuses it) and let the SwapWatcher validate, smoke-decode
   and swap it in between decode steps;
3. every ``guard_interval_s``: the collapse guard. Its rollback swaps the previous drafter back at
   once, refuses the collapsed version locally (so polling never swaps it in again), then moves
   the registry alias back (``registry.rollback``, actor ``collapse-guard``; retried each poll
   while the registry is unreachable). With no previous champion anywhere (the drafter served
   before the registry was first reached does not count) it only alerts: a weak drafter still
   beats none.
The control API (tide/ops/control_api.py) calls ``check_now``, ``promote`` and ``rollback`` from
request threads; one lock serialises everything that can swap. ``promote`` validates the
version on this engine before the alias moves, so an operator cannot point ``champion`` at a
drafter this engine would refuse.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Callable

from tide import metrics
from tide.contracts import CHAMPION, PREVIOUS_CHAMPION
from tide.drafter.artifact import DrafterError
from tide.engine.base import Engine
from tide.ops.guard import CollapseGuard
from tide.ops.inventory import live_acceptance_from_stats, version_record
from tide.ops.swap import SwapOutcome, SwapWatcher
from tide.registry import ChecksumError, Registry, RegistryError

log = logging.getLogger(__name__)

GUARD_ACTOR = "collapse-guard"
DEFAULT_SMOKE_IDS = [5, 6, 7, 8, 9, 10]  # when the engine has no tokenizer (tests)


class OpsError(RuntimeError):
    """An operation was not done; ``status`` is the HTTP status the control API answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DrafterFollower:
    def __init__(self, engine: Engine, cfg, connect: Callable[[], Registry], bootstrap_path: Path | None = None,
                 smoke_prompt_ids: list[int] | None = None) -> None:
        """``cfg`` is the OpsConfig; ``connect`` builds a Registry (raises while unreachable)."""
        self.engine = engine
        self.cfg = cfg
        self.registry: Registry | None = None
        self._connect = connect
        self._bootstrap_path = bootstrap_path
        self.watcher = SwapWatcher(engine, self._resolve, smoke_prompt_ids or DEFAULT_SMOKE_IDS,
                                   cfg.poll_interval_s)
        self.guard = CollapseGuard(engine, self._guard_rollback, cfg.guard_floor, cfg.guard_min_ratio,
                                   cfg.guard_window_forwards) if cfg.guard_enabled else None
        self.last_check: SwapOutcome | None = None
        self.last_error: str | None = None
        self.connected = False  # the last registry call of the follower succeeded
        self._synced = False  # the engine has served the followed alias at least once
        self._pending_rollback: tuple[str, str] | None = None  # (collapsed version, reason)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, engine, cfg) -> "DrafterFollower":
        """From a whole TideConfig: registry from ``cfg.registry``, bootstrap from ``cfg.drafter``."""
        from tide.drafter.static import static_drafter_path

        try:
            path = static_drafter_path(cfg) if cfg.drafter.path == "static" else Path(cfg.drafter.path)
        except DrafterError:
            path = None
        tok = engine.tokenizer
        ids = list(tok.encode(cfg.ops.smoke_prompt)) if tok is not None else None
        return cls(engine, cfg.ops, lambda: Registry.from_config(cfg), path, ids)

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, block: bool = True) -> None:
        """Start the thread; with ``block`` the first connect + check happen before returning,
        so a healthy engine already serves the champion (failures are logged, never raised)."""
        if block:
            self._tick_registry()
        self._thread = threading.Thread(target=self._run, name="tide-ops", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        cfg = self.cfg
        tick_s = max(0.01, min(0.5, cfg.poll_interval_s / 2, cfg.guard_interval_s / 2))
        next_poll = time.monotonic() + cfg.poll_interval_s
        next_guard = time.monotonic() + cfg.guard_interval_s
        next_connect = time.monotonic() + cfg.registry_retry_s
        while not self._stop.wait(tick_s):
            now = time.monotonic()
            try:  # this thread must outlive any bug in one step
                if self.registry is None and now >= next_connect:
                    next_connect = now + cfg.registry_retry_s
                    self._tick_registry()
                elif self.registry is not None and now >= next_poll:
                    next_poll = now + cfg.poll_interval_s
                    self._tick_registry()
                if self.guard is not None and now >= next_guard:
                    next_guard = now + cfg.guard_interval_s
                    with self._lock:
                        self.guard.check()
            except Exception:  # noqa: BLE001
                log.exception("drafter follower step failed; continuing")

    def _tick_registry(self) -> None:
        if self.registry is None and not self._connect_once():
            return
        self._retry_registry_rollback()
        self.check_now()

    def _connect_once(self) -> bool:
        try:
            registry = self._connect()
        except Exception as exc:  # noqa: BLE001 - RegistryError, or a store that is half up
            self.last_error, self.connected = f"registry unreachable: {exc}", False
            metrics.OPS_REGISTRY_CONNECTED.set(0)
            log.warning("drafter follower: %s; serving %s, retrying in %.0f s", self.last_error,
                        self.engine.drafter_version, self.cfg.registry_retry_s)
            return False
        if self.cfg.bootstrap_static and self._bootstrap_path is not None:
            try:
                registry.ensure_bootstrap(self._bootstrap_path)
            except Exception as exc:  # noqa: BLE001 - following still works without it
                log.error("drafter follower: could not register %s as the first champion: %s",
                          self._bootstrap_path, exc)
        self.registry, self.connected, self.last_error = registry, True, None
        metrics.OPS_REGISTRY_CONNECTED.set(1)
        log.info("drafter follower: following %s of %s at %s", self.cfg.follow_alias,
                 registry.model_name, registry.tracking_uri)
        return True

    # --- following ----------------------------------------------------------------------------
    def _resolve(self) -> tuple[str, Path] | None:
        """The watcher's resolver: (version, verified local folder) of the followed alias.

        No download when the engine already serves that version or refused it (the watcher
        answers from the version alone); a checksum mismatch refuses the version for good.
        """
        registry = self.registry
        if registry is None:
            raise RegistryError("registry not connected")
        info = registry.get_alias(self.cfg.follow_alias)
        if info is None:
            return None
        version = str(info.version)
        if version == self.engine.drafter_version or version in self.watcher.refused:
            return version, Path()
        try:
            return version, registry.download(info.version)
        except ChecksumError as exc:
            self._refuse(version, str(exc))
            return version, Path()

    def _refuse(self, version: str, reason: str) -> None:
        self.watcher.refused[version] = reason
        metrics.OPS_SWAPS.labels("refused").inc()
        log.error("refusing drafter version %s: %s", version, reason)

    def check_now(self) -> SwapOutcome:
        """Follow the alias now (poll loop and POST /control/check)."""
        with self._lock:
            if self.registry is None:
                outcome = SwapOutcome("error", None, self.last_error or "registry not connected")
            else:
                outcome = self.watcher.check_now()
                if outcome.status == "swapped" and not self._synced:
                    # the drafter configured before the registry was reached is no champion: a
                    # rollback must never land on it (e.g. a stale local copy)
                    self.watcher.previous = None
                self._synced = self._synced or outcome.status in ("swapped", "unchanged")
            self.connected = outcome.status != "error"
            self.last_error = None if self.connected else outcome.detail
            metrics.OPS_REGISTRY_CONNECTED.set(1 if self.connected else 0)
            self.last_check = outcome
            return outcome

    def _swap_to_version(self, version: str) -> SwapOutcome:
        """After the alias moved: the kept previous drafter if it is that version (no download,
        no validation: it served minutes ago), else the normal follow path."""
        if version == self.engine.drafter_version:
            return SwapOutcome("unchanged", version)
        previous = self.watcher.previous
        if previous is not None and previous[0] == version:
            return self.watcher.swap_to(*previous)
        return self.check_now()

    # --- operations ---------------------------------------------------------------------------
    def _registry_or_raise(self) -> Registry:
        if self.registry is None:
            raise OpsError(503, f"registry not connected ({self.last_error or 'connecting'}); "
                                f"serving {self.engine.drafter_version}")
        return self.registry

    def promote(self, version: int, actor: str, reason: str = "") -> dict:
        """Validate ``version`` on this engine, move ``champion`` to it, and serve it."""
        registry = self._registry_or_raise()
        with self._lock:
            v, drafter = str(version), None
            try:
                registry.get_version(version)
                if v != self.engine.drafter_version:
                    drafter = self.watcher.validate(registry.download(version))
            except ChecksumError as exc:
                self._refuse(v, str(exc))
                raise OpsError(409, f"version {v} refused: {exc}") from exc
            except RegistryError as exc:
                raise OpsError(404 if "has no version" in str(exc) else 503, str(exc)) from exc
            except (DrafterError, ValueError, RuntimeError) as exc:  # validation, smoke decode
                self._refuse(v, str(exc))
                raise OpsError(409, f"version {v} refused: {exc}") from exc
            try:
                old, new = registry.promote(version, actor=actor, reason=reason)
            except RegistryError as exc:
                raise OpsError(409 if "not completely registered" in str(exc) else 503, str(exc)) from exc
            self.watcher.refused.pop(v, None)  # an operator's explicit choice of a validated version
            outcome = self.watcher.swap_to(v, drafter) if drafter is not None else SwapOutcome("unchanged", v)
            return self._result("promote", actor, old, new, outcome)

    def rollback(self, actor: str, reason: str = "") -> dict:
        """``champion`` back to ``previous-champion`` in the registry, and serve it."""
        registry = self._registry_or_raise()
        with self._lock:
            try:
                old, new = registry.rollback(actor=actor, reason=reason)
            except RegistryError as exc:
                raise OpsError(409 if "no previous champion" in str(exc) else 503, str(exc)) from exc
            metrics.OPS_ROLLBACKS.labels("operator").inc()
            return self._result("rollback", actor, old, new, self._swap_to_version(str(new)))

    def _result(self, op: str, actor: str, old, new, outcome: SwapOutcome) -> dict:
        self.last_check = outcome
        return {"op": op, "actor": actor, "from": old, "to": new, "serving": self.engine.drafter_version,
                "outcome": dataclasses.asdict(outcome),
                "engine_swap_pause_s": self.engine.last_swap_pause_s}

    def _guard_rollback(self, reason: str) -> None:
        """The collapse guard's rollback (steps in the module docstring, step 3)."""
        bad = self.engine.drafter_version
        previous = self.watcher.previous
        if previous is None and not self._registry_has_previous():
            # e.g. the first champion on traffic it does poorly on: nothing better to serve
            log.error("collapse guard: %s; no previous champion to roll back to, %s keeps serving",
                      reason, bad)
            return
        self.watcher.refused[bad] = reason
        if previous is not None and previous[0] != bad:
            self.watcher.swap_to(*previous)
        self._pending_rollback = (bad, reason)
        self._retry_registry_rollback()

    def _registry_has_previous(self) -> bool:
        if self.registry is None or self.cfg.follow_alias != CHAMPION:
            return False
        try:
            return PREVIOUS_CHAMPION in self.registry.aliases()
        except RegistryError:
            return False

    def _retry_registry_rollback(self) -> None:
        pending, registry = self._pending_rollback, self.registry
        if pending is None or registry is None:
            return
        bad, reason = pending
        if self.cfg.follow_alias != CHAMPION:  # only champion has a previous to go back to
            self._pending_rollback = None
            return
        try:
            aliases = registry.aliases()
            if str(aliases.get(CHAMPION)) == bad:
                if PREVIOUS_CHAMPION not in aliases:
                    log.error("collapse guard: registry has no previous champion; %s stays champion "
                              "there but this engine refuses it", bad)
                else:
                    registry.rollback(actor=GUARD_ACTOR, reason=reason)
            self._pending_rollback = None
        except RegistryError as exc:
            log.warning("collapse guard: registry rollback of %s pending: %s", bad, exc)
            return
        self.check_now()  # converge on whatever the registry now says

    # --- reading --------------------------------------------------------------------------------
    def drafters(self) -> dict:
        """Registered versions with the live acceptance this engine measured (GET /control/drafters)."""
        registry = self._registry_or_raise()
        live = live_acceptance_from_stats(self.engine.stats().acceptance)
        try:
            versions = registry.list_versions()
        except RegistryError as exc:
            raise OpsError(503, str(exc)) from exc
        return {"serving": self.engine.drafter_version, "follow_alias": self.cfg.follow_alias,
                "live_accept_length": live, "versions": [version_record(v, live) for v in versions]}

    def operations(self) -> list[dict]:
        try:
            return self._registry_or_raise().operations()
        except RegistryError as exc:
            raise OpsError(503, str(exc)) from exc

    def health(self) -> dict:
        previous = self.watcher.previous
        return {"registry_connected": self.connected,
                "follow_alias": self.cfg.follow_alias, "serving": self.engine.drafter_version,
                "previous": previous[0] if previous else None, "refused": dict(self.watcher.refused),
                "last_check": dataclasses.asdict(self.last_check) if self.last_check else None,
                "last_error": self.last_error,
                "pending_registry_rollback": self._pending_rollback[0] if self._pending_rollback else None,
                "guard": None if self.guard is None else {"baselines": dict(self.guard.baselines)}}
