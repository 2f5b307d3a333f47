"""The one alias writer: every change of ``champion`` and ``previous-champion`` goes through here.

Writers: the operator (``tide drafters promote|rollback``, an engine's POST /control/promote|rollback),
the retrain's auto-promotion and each engine replica's collapse report. MLflow has no conditional
alias write, so writers that each read the aliases and then write two or three of them interleave
(a promotion landing over a collapse rollback leaves ``champion`` on a drafter trained from the
collapsed one, or no ``previous-champion``). ``AliasOwner`` serialises them:
1. one lock around every read-decide-apply: a thread lock and an exclusive ``flock`` on
   ``lock_path`` (by default beside the scheduler's state file, its lease), so writers of one host or
   volume apply operations one at a time;
2. under it, each operation reads the ledger's head (tide/registry/ledger.py), rolls a half-applied
   operation forward, decides on that state and applies one numbered operation: the history is
   one linear sequence;
3. fencing: an operator's promote or rollback carries the generation it read and validated against
   (``expected_generation``); when another operation came first it raises ``AliasConflict``
   ("conflict ... retry") and writes nothing;
4. decisions are taken on the state under the lock, never on a copy read earlier: auto-promotion
   runs the policy (tide/ops/promotion.py) there, and a collapse report rolls back only while the
   champion is the collapsed version or was trained from it, to the newest earlier champion that
   is neither, so N replicas reporting one collapse cause one rollback.
Processes elsewhere (engine replicas, retrain Jobs, an operator's CLI) reach the owner the scheduler
hosts through its authenticated HTTP API (tide/ops/alias_api.py, whose ``alias_writer`` returns that client when
``ops.alias_owner_url`` is set, else an owner in this process on the same lock file).
An operation that cannot apply to the state (nothing to roll back to, a version not completely
registered, a policy that says no) returns ``applied=False`` with the reason; only a lost race
(``AliasConflict``), a bad token and an unreachable owner or registry raise.
"""
from __future__ import annotations

import dataclasses
import fcntl
import logging
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tide import metrics
from tide.contracts import TAG_ROLLED_BACK
from tide.ops.promotion import ACTOR as AUTO_ACTOR
from tide.ops.promotion import decide
from tide.registry import AliasState, Registry, VersionInfo

log = logging.getLogger(__name__)

GUARD_ACTOR = "collapse-guard"


class AliasError(RuntimeError):
    """An alias operation was not done; the message says why."""


class AliasConflict(AliasError):
    """Another operation came first: read the aliases again and retry."""


class AliasAuthError(AliasError):
    """The alias owner refused the token: nothing was written."""


class AliasUnavailable(AliasError):
    """The alias owner (or the registry behind it) did not answer: nothing is known to be written."""


@dataclasses.dataclass(frozen=True)
class AliasResult:
    """What an operation did: ``state`` is the ledger's head after it (generation, champion, ...)."""

    applied: bool
    op: str
    detail: str
    state: dict
    record: dict | None = None  # the ledger record, when applied
    decision: dict | None = None  # auto-promotion's PromotionDecision

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, body: dict) -> "AliasResult":
        return cls(**{f.name: body.get(f.name) for f in dataclasses.fields(cls)})

    @property
    def moved(self) -> tuple[int | None, int | None]:
        """(from, to) of the champion; (champion, champion) when nothing was applied."""
        if self.record is not None:
            return self.record["from"], self.record["to"]
        return self.state.get("champion"), self.state.get("champion")


def descends_from(versions: dict[int, VersionInfo], version: int | None, ancestor: int) -> bool:
    """``version`` is ``ancestor`` or was trained (warm-started) from it, through any generations."""
    seen: set[int] = set()
    while version is not None and version not in seen:
        if version == ancestor:
            return True
        seen.add(version)
        parent = versions[version].parent_version if version in versions else ""
        version = int(parent) if parent.isdigit() else None
    return False


class AliasOwner:
    """Applies alias operations one at a time (steps in the module docstring)."""

    def __init__(self, registry: Registry, lock_path: Path | None = None) -> None:
        self.registry = registry
        self.lock_path = Path(lock_path) if lock_path else None
        self._lock = threading.Lock()

    @contextmanager
    def _locked(self) -> Iterator[AliasState]:
        with self._lock, self._file_lock():
            yield self.registry.roll_forward(self.registry.alias_state())

    @contextmanager
    def _file_lock(self) -> Iterator[None]:
        if self.lock_path is None:
            yield
            return
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    # --- reading --------------------------------------------------------------------------------
    def state(self) -> dict:
        return self.registry.alias_state().to_dict()

    def operations(self) -> list[dict]:
        return self.registry.operations()

    def report_replica(self, record: dict) -> None:
        """A replica's served version: only an owner the fleet reports to keeps them (alias_api)."""

    # --- operations -----------------------------------------------------------------------------
    def promote(self, version: int, actor: str, reason: str = "",
                expected_generation: int | None = None) -> AliasResult:
        with self._locked() as state:
            self._fence(state, expected_generation, "promote")
            if not self.registry.get_version(version).complete:  # an unknown version raises
                return self._not_applied("promote", state, f"version {version} is not completely registered")
            self.registry.promote(version, actor=actor, reason=reason)
            return self._applied("promote")

    def rollback(self, actor: str, reason: str = "", expected_generation: int | None = None) -> AliasResult:
        with self._locked() as state:
            self._fence(state, expected_generation, "rollback")
            if state.previous is None:
                return self._not_applied("rollback", state, "no previous champion to roll back to")
            self.registry.rollback(actor=actor, reason=reason)
            return self._applied("rollback")

    def auto_promote(self, margin: float, actor: str = AUTO_ACTOR) -> AliasResult:
        """The auto-promotion policy on the aliases as they are now; promotes when it says yes."""
        with self._locked() as state:
            challenger = self.registry.get_version(state.challenger) if state.challenger else None
            champion = self.registry.get_version(state.champion) if state.champion else None
            decision = decide(challenger, champion, margin)
            if not decision.promote:
                return self._not_applied("auto-promote", state, decision.reason, decision.to_dict())
            self.registry.promote(decision.challenger, actor=actor, reason=decision.reason)
            return self._applied("auto-promote", decision.to_dict())

    def report_collapse(self, version: int, reason: str, replica: str = "") -> AliasResult:
        """A replica saw ``version`` collapse: tag it, and roll back once if the champion is it or
        descends from it (steps in the module docstring)."""
        with self._locked() as state:
            versions = {v.version: v for v in self.registry.list_versions(with_run=False)}
            if version in versions and not versions[version].tags.get(TAG_ROLLED_BACK):
                self.registry.set_version_tag(version, TAG_ROLLED_BACK, reason)
            champion = state.champion
            if champion is None or not descends_from(versions, champion, version):
                return self._not_applied("collapse", state, f"champion {champion} is neither {version} nor "
                                         "trained from it: nothing to roll back")
            target = self._last_good(state, versions, version)
            if target is None:
                return self._not_applied("collapse", state, f"no earlier champion to roll back to; {champion} "
                                         f"stays champion (engines refuse {version} locally)")
            self.registry.rollback(actor=GUARD_ACTOR, reason=reason, to=target, collapsed=version,
                                   replica=replica)
            log.warning("collapse of %s reported by %s: champion %s -> %s", version, replica or "?", champion,
                        target)
            return self._applied("collapse")

    def _last_good(self, state: AliasState, versions: dict[int, VersionInfo], collapsed: int) -> int | None:
        """previous-champion, else the newest champion of the history, that is neither ``collapsed``
        nor trained from it."""
        ops = self.registry.operations()
        candidates = [state.previous] + [op.get("to") for op in reversed(ops)] + [op.get("from") for op in ops[:1]]
        for c in candidates:
            if c is not None and c != state.champion and c in versions and not descends_from(versions, c, collapsed):
                return c
        return None

    # --- results --------------------------------------------------------------------------------
    @staticmethod
    def _fence(state: AliasState, expected: int | None, op: str) -> None:
        if expected is not None and int(expected) != state.generation:
            metrics.OPS_ALIAS_OPERATIONS.labels(op, "conflict").inc()
            raise AliasConflict(f"conflict: {op} was decided at alias generation {expected}, but another "
                                f"operation came first (generation {state.generation}, champion "
                                f"{state.champion}); read the aliases again and retry")

    def _applied(self, op: str, decision: dict | None = None) -> AliasResult:
        after = self.registry.alias_state()
        metrics.OPS_ALIAS_OPERATIONS.labels(op, "applied").inc()
        metrics.OPS_ALIAS_GENERATION.set(after.generation)
        record = after.last or {}
        return AliasResult(True, op, f"champion {record.get('from')} -> {record.get('to')}", after.to_dict(),
                           after.last, decision)

    @staticmethod
    def _not_applied(op: str, state: AliasState, detail: str, decision: dict | None = None) -> AliasResult:
        metrics.OPS_ALIAS_OPERATIONS.labels(op, "not_applied").inc()
        return AliasResult(False, op, detail, state.to_dict(), None, decision)


def owner_token(cfg) -> str:
    """The token of the alias owner's API: ``ops.alias_owner_token``, else ``server.control_token``."""
    return cfg.ops.alias_owner_token or cfg.server.control_token


def default_lock_path(cfg) -> Path:
    """``ops.alias_lock_path``, else ``alias.lock`` beside the scheduler's state file (its lease)."""
    from tide.schedule.scheduler import default_state_path

    return Path(cfg.ops.alias_lock_path) if cfg.ops.alias_lock_path else default_state_path(cfg).parent / "alias.lock"
