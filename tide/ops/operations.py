"""The drafter follower's operations, from the control API's request threads: promote, roll back,
list versions with this engine's live acceptance, read the operations history.

``promote`` validates the version on this engine (download, checks, smoke decode) before it asks
the alias writer, fenced by the generation it read before validating, so an operator cannot point
``champion`` at a drafter this engine would refuse, nor over a change made meanwhile (409
"conflict ... retry"). ``rollback`` asks the alias writer, then serves the kept previous drafter
when it is the new champion. Failures are ``OpsError`` with the HTTP status the control API answers.
A mixin of ``DrafterFollower`` (tide/ops/follower.py): the engine, watcher, registry, writer and
locks are the follower's.
"""
from __future__ import annotations

import dataclasses

from tide import metrics
from tide.drafter.artifact import DrafterError
from tide.ops.aliases import AliasConflict, AliasError
from tide.ops.inventory import live_acceptance_from_stats, version_record
from tide.ops.swap import SwapOutcome
from tide.registry import Registry, RegistryError, UntrustedVersion


class OpsError(RuntimeError):
    """An operation was not done; ``status`` is the HTTP status the control API answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Operations:
    """promote / rollback / drafters / operations over the follower's state."""

    def _registry_or_raise(self) -> Registry:
        if self.registry is None:
            raise OpsError(503, f"registry not connected ({self.last_error or 'connecting'}); "
                                f"serving {self.engine.drafter_version}")
        return self.registry

    def promote(self, version: int, actor: str, reason: str = "") -> dict:
        """Validate ``version`` on this engine, move ``champion`` to it (through the alias writer,
        fenced by the generation read before validating), and serve it."""
        self._registry_or_raise()
        with self._op_lock:
            v, drafter = str(version), None
            try:
                generation = self._write(lambda w: w.state())["generation"]
                self.registry.get_version(version)
                if v != self.engine.drafter_version:
                    drafter = self.watcher.validate(self.registry.download(version))
            except UntrustedVersion as exc:
                self.watcher.refuse(v, str(exc))
                raise OpsError(409, f"version {v} refused: {exc}") from exc
            except RegistryError as exc:
                raise OpsError(404 if "has no version" in str(exc) else 503, str(exc)) from exc
            except OpsError:
                raise
            except Exception as exc:  # noqa: BLE001 - validation, smoke decode: the version's fault
                detail = str(exc) if isinstance(exc, DrafterError) else f"{type(exc).__name__}: {exc}"
                self.watcher.refuse(v, detail)
                raise OpsError(409, f"version {v} refused: {detail}") from exc
            result = self._write(lambda w: w.promote(version, actor, reason, expected_generation=generation))
            if not result.applied:
                raise OpsError(409, result.detail)
            old, new = result.moved
            with self._swap_lock:
                self.watcher.refused.pop(v, None)  # an operator's explicit choice of a validated version
            outcome = self.watcher.swap_to(v, drafter) if drafter is not None else SwapOutcome("unchanged", v)
            return self._result("promote", actor, old, new, outcome)

    def rollback(self, actor: str, reason: str = "") -> dict:
        """``champion`` back to ``previous-champion`` (through the alias writer), and serve it."""
        self._registry_or_raise()
        with self._op_lock:
            result = self._write(lambda w: w.rollback(actor, reason))
            if not result.applied:
                raise OpsError(409, result.detail)
            old, new = result.moved
            metrics.OPS_ROLLBACKS.labels("operator").inc()
            return self._result("rollback", actor, old, new, self._swap_to_version(str(new)))

    def _write(self, call):
        """One call to the alias writer; its failures as the control API's statuses."""
        try:
            return call(self.writer)
        except AliasConflict as exc:
            raise OpsError(409, str(exc)) from exc
        except RegistryError as exc:
            raise OpsError(404 if "has no version" in str(exc) else 503, str(exc)) from exc
        except AliasError as exc:
            raise OpsError(503, str(exc)) from exc

    def _result(self, op: str, actor: str, old, new, outcome: SwapOutcome) -> dict:
        self.last_check = outcome
        return {"op": op, "actor": actor, "from": old, "to": new, "serving": self.engine.drafter_version,
                "outcome": dataclasses.asdict(outcome),
                "engine_swap_pause_s": self.engine.last_swap_pause_s}

    def drafters(self) -> dict:
        """Registered versions with the live acceptance this engine measured (GET /control/drafters)."""
        registry = self._registry_or_raise()
        live = live_acceptance_from_stats(self.engine.stats().acceptance)
        try:
            versions = registry.list_versions()
        except RegistryError as exc:
            raise OpsError(503, str(exc)) from exc
        return {"serving": self.engine.drafter_version, "follow_alias": self.cfg.follow_alias,
                "live_accept_length": live,
                "versions": [version_record(v, live, self.engine.drafter_version) for v in versions]}

    def operations(self) -> list[dict]:
        try:
            return self._registry_or_raise().operations()
        except RegistryError as exc:
            raise OpsError(503, str(exc)) from exc
