"""Drafter follower: the engine-side owner of the swap watcher, the collapse guard and the registry.

Two background threads, so that the guard never waits behind a registry call:
- "tide-ops-registry" repeats until stopped:
  1. while no registry is connected: try to connect every ``registry_retry_s`` (the engine keeps
     serving the drafter it has; inference never waits on the registry); on first contact,
     register the configured drafter as champion if the registry has no version yet;
  2. every ``poll_interval_s`` (at once when the guard asks): report a pending collapse, then
     ``check_now``: read the aliases, download the followed version (tide/registry/artifacts.py
     checks its record and files; a version that fails is refused for good) and let the
     SwapWatcher validate, smoke-decode and swap it in; then report this replica to the fleet view
     (tide/ops/fleet.py: served version and since when, the followed one, when it converged, what
     it refused and why; gauges ``tide_ops_converged``, ``tide_ops_serving_since_timestamp_seconds``).
- "tide-ops-guard", every ``guard_interval_s``: the collapse guard, which touches only the engine
  and the last aliases the registry thread read. Its rollback swaps the previous drafter back at
  once and refuses the collapsed version locally (so polling never swaps it in again); the
  registry thread reports the collapse to the alias owner (retried each poll while it or the
  registry is unreachable or hangs), which rolls ``champion`` back once for the fleet. With no
  previous champion anywhere (the drafter served before the registry was first reached does not
  count) it only alerts: a weak drafter still beats none.
Every alias change (``promote``, ``rollback``, a collapse report) goes through the alias writer
(tide/ops/aliases.py: the owner's API, or an owner in this process); the follower writes none.
Locks: ``_op_lock`` serialises registry-side work (polls, and the control API's ``check_now``,
``promote``, ``rollback`` from request threads; it may be held across a slow registry call);
the watcher's ``swap_lock`` guards what serves and what is refused and is held only for a swap.
The guard takes only the swap lock. ``promote`` validates the version on this engine before the
alias moves, so an operator cannot point ``champion`` at a drafter this engine would refuse.
State (``health``/``state``): ``connecting``, ``registry unreachable``, ``following`` (serving
the followed version), ``refused`` (the alias points at a version this engine refused; it
serves the one it had, ``tide_ops_followed_version_refused`` is 1): a refused version is the
registry's content, not an outage; or ``not applied`` (the engine did not apply the swap to the
followed version in time; it serves the one it had, ``serving`` says which, and each poll asks again).
"""
from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from tide import metrics
from tide.contracts import CHAMPION, PREVIOUS_CHAMPION
from tide.drafter.artifact import DrafterError
from tide.engine.base import Engine
from tide.ops.alias_api import alias_writer
from tide.ops.aliases import AliasError, AliasOwner
from tide.ops.fleet import replica_record
from tide.ops.guard import CollapseGuard
from tide.ops.operations import Operations, OpsError
from tide.ops.swap import SwapOutcome, SwapWatcher
from tide.registry import Registry, RegistryError, UntrustedVersion

__all__ = ["DrafterFollower", "OpsError"]
log = logging.getLogger(__name__)

GUARD_ACTOR = "collapse-guard"
DEFAULT_SMOKE_IDS = [5, 6, 7, 8, 9, 10]  # when the engine has no tokenizer (tests)


class DrafterFollower(Operations):
    def __init__(self, engine: Engine, cfg, connect: Callable[[], Registry], bootstrap_path: Path | None = None,
                 smoke_prompt_ids: list[int] | None = None, writer: Callable[[Registry], object] | None = None,
                 replica: str = "") -> None:
        """``cfg`` is the OpsConfig; ``connect`` builds a Registry (raises while unreachable);
        ``writer`` the alias writer over it (default: an AliasOwner in this process)."""
        self.engine = engine
        self.cfg = cfg
        self.registry: Registry | None = None
        self.writer = None  # set with the registry
        self.replica = replica or socket.gethostname()
        self._connect = connect
        self._make_writer = writer or AliasOwner
        self._followed: tuple[str | None, float] = (None, time.time())  # (version, since when)
        self._fleet_error: str | None = None
        self._bootstrap_path = bootstrap_path
        self._swap_lock = threading.RLock()
        self.watcher = SwapWatcher(engine, self._resolve, smoke_prompt_ids or DEFAULT_SMOKE_IDS,
                                   cfg.poll_interval_s, swap_lock=self._swap_lock,
                                   apply_timeout_s=cfg.swap_apply_timeout_s)
        self.guard = CollapseGuard(engine, self._guard_rollback, cfg.guard_floor, cfg.guard_min_ratio,
                                   cfg.guard_window_forwards) if cfg.guard_enabled else None
        self.last_check: SwapOutcome | None = None
        self.last_error: str | None = None
        self.connected = False  # the last registry call of the follower succeeded
        self._synced = False  # the engine has served the followed alias at least once
        self._pending_rollback: tuple[str, str] | None = None  # (collapsed version, reason)
        self._aliases: dict[str, int] = {}  # as the registry thread last read them (the guard's view)
        self._registry_call_since: float | None = None  # monotonic start of the registry work in flight
        self._op_lock = threading.RLock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # the guard asks the registry thread to act now
        self._threads: list[threading.Thread] = []

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
        return cls(engine, cfg.ops, lambda: Registry.from_config(cfg), path, ids,
                   writer=lambda registry: alias_writer(cfg, registry),
                   replica=f"{socket.gethostname()}:{cfg.server.port}")

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, block: bool = True) -> None:
        """Start the threads; with ``block`` the first connect + check happen before returning,
        so a healthy engine already serves the champion (failures are logged, never raised)."""
        if block:
            self._tick_registry()
        self._threads = [threading.Thread(target=self._registry_loop, name="tide-ops-registry", daemon=True)]
        if self.guard is not None:
            self._threads.append(threading.Thread(target=self._guard_loop, name="tide-ops-guard", daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """A registry call that hangs is left to its daemon thread (bounded by MLflow's timeout)."""
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _registry_loop(self) -> None:
        cfg = self.cfg
        tick_s = max(0.01, min(0.5, cfg.poll_interval_s / 2))
        next_poll = time.monotonic() + cfg.poll_interval_s
        next_connect = time.monotonic() + cfg.registry_retry_s
        while not self._stop.is_set():
            self._wake.wait(tick_s)
            now, woken = time.monotonic(), self._wake.is_set()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:  # this thread must outlive any bug in one step
                if self.registry is None and now >= next_connect:
                    next_connect = now + cfg.registry_retry_s
                    self._tick_registry()
                elif self.registry is not None and (now >= next_poll or woken):
                    next_poll = now + cfg.poll_interval_s
                    self._tick_registry()
            except Exception:  # noqa: BLE001
                log.exception("drafter follower: registry step failed; continuing")

    def _guard_loop(self) -> None:
        while not self._stop.wait(self.cfg.guard_interval_s):
            try:
                with self._swap_lock:
                    self.guard.check()
            except Exception:  # noqa: BLE001
                log.exception("collapse guard step failed; continuing")

    def _tick_registry(self) -> None:
        with self._op_lock:
            self._registry_call_since = time.monotonic()
            try:
                if self.registry is None and not self._connect_once():
                    return
                self._retry_registry_rollback()
                self.check_now()
                self._report_replica()
            finally:
                self._registry_call_since = None

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
        self.writer = self._make_writer(registry)
        metrics.OPS_REGISTRY_CONNECTED.set(1)
        log.info("drafter follower: following %s of %s at %s", self.cfg.follow_alias,
                 registry.model_name, registry.shown_uri)
        return True

    # --- following ----------------------------------------------------------------------------
    def _resolve(self) -> tuple[str, Path] | None:
        """The watcher's resolver: (version, verified local folder) of the followed alias.

        No download when the engine already serves that version or refused it (the watcher
        answers from the version alone); a version whose record or files cannot be trusted is
        refused for good.
        """
        registry = self.registry
        if registry is None:
            raise RegistryError("registry not connected")
        self._aliases = registry.aliases()
        number = self._aliases.get(self.cfg.follow_alias)
        if number is None:
            return None
        version = str(number)
        if version != self._followed[0]:
            self._followed = (version, time.time())
        if version == self.engine.drafter_version or version in self.watcher.refused:
            return version, Path()
        try:
            return version, registry.download(number)
        except UntrustedVersion as exc:
            self.watcher.refuse(version, str(exc))
            return version, Path()

    def check_now(self) -> SwapOutcome:
        """Follow the alias now (poll loop and POST /control/check)."""
        with self._op_lock:
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
            if outcome.status != "error":
                metrics.OPS_FOLLOWED_REFUSED.set(1 if outcome.status == "refused" else 0)
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

    def _guard_rollback(self, reason: str) -> None:
        """The collapse guard's rollback, in the guard thread: no registry call here."""
        bad = self.engine.drafter_version
        previous = self.watcher.previous
        registry_previous = self.cfg.follow_alias == CHAMPION and PREVIOUS_CHAMPION in self._aliases
        if previous is None and not registry_previous:
            # e.g. the first champion on traffic it does poorly on: nothing better to serve
            log.error("collapse guard: %s; no previous champion to roll back to, %s keeps serving",
                      reason, bad)
            return
        self.watcher.refused[bad] = reason
        if previous is not None and previous[0] != bad:
            self.watcher.swap_to(*previous)
        self._pending_rollback = (bad, reason)
        self._wake.set()  # the registry thread reports it (or keeps trying while the registry hangs)

    def _retry_registry_rollback(self) -> None:
        """Report a pending collapse to the alias owner, which decides the fleet-wide rollback once."""
        pending, writer = self._pending_rollback, self.writer
        if pending is None or writer is None:
            return
        bad, reason = pending
        if self.cfg.follow_alias != CHAMPION or not bad.isdigit():  # no registry version to roll back
            self._clear_pending(pending)
            return
        try:
            result = writer.report_collapse(int(bad), reason, self.replica)
        except (AliasError, RegistryError) as exc:
            log.warning("collapse guard: report of %s to the alias owner pending: %s", bad, exc)
            return
        log.info("collapse guard: reported %s: %s", bad, result.detail)
        self._clear_pending(pending)
        self.check_now()  # converge on whatever the registry now says

    def _clear_pending(self, done: tuple[str, str]) -> None:
        with self._swap_lock:  # the guard may have queued a newer rollback meanwhile
            if self._pending_rollback == done:
                self._pending_rollback = None

    @property
    def state(self) -> str:
        if self.registry is None:
            return "registry unreachable" if self.last_error else "connecting"
        if not self.connected:
            return "registry unreachable"
        status = self.last_check.status if self.last_check is not None else None
        return {"refused": "refused", "not_applied": "not applied"}.get(status, "following")

    def rollout(self) -> dict:
        """This replica's part of the fleet view; also sets the rollout gauges."""
        serving, (followed, followed_since_s) = self.engine.drafter_version, self._followed
        serving_since_s = self.watcher.serving_since_s
        converged = followed is not None and serving == followed
        metrics.OPS_CONVERGED.set(1 if converged else 0)
        metrics.OPS_SERVING_SINCE.set(serving_since_s)
        return replica_record(self.replica, serving, followed, self.state, serving_since_s,
                              max(serving_since_s, followed_since_s) if converged else None,
                              self.watcher.refused, self.last_error, self.cfg.poll_interval_s)

    def _report_replica(self) -> None:
        record, writer = self.rollout(), self.writer
        if writer is None:
            return
        try:
            writer.report_replica(record)
            self._fleet_error = None
        except (AliasError, RegistryError) as exc:
            if str(exc) != self._fleet_error:  # once per distinct failure, not every poll
                log.warning("drafter follower: cannot report to the fleet view: %s", exc)
            self._fleet_error = str(exc)

    def health(self) -> dict:
        previous, since = self.watcher.previous, self._registry_call_since
        rollout = self.rollout()
        return {"state": self.state, "registry_connected": self.connected, "rollout": rollout,
                "follow_alias": self.cfg.follow_alias, "serving": self.engine.drafter_version,
                "previous": previous[0] if previous else None, "refused": dict(self.watcher.refused),
                "last_check": dataclasses.asdict(self.last_check) if self.last_check else None,
                "last_error": self.last_error,
                "registry_call_s": None if since is None else round(time.monotonic() - since, 3),
                "pending_registry_rollback": self._pending_rollback[0] if self._pending_rollback else None,
                "guard": None if self.guard is None else {"baselines": dict(self.guard.baselines)}}
