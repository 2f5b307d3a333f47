"""The alias ledger: ``champion`` and ``previous-champion`` move only as numbered operations.

MLflow has no conditional alias write, so the aliases alone cannot say which of two writers came
last. Every alias change is therefore one operation of a ledger kept as tags of the registered
model, written ahead of the aliases it moves:
1. ``tide.op.g<seq>``: the operation (op, actor, from, to, reason, time) and the whole alias state
   it leaves (``aliases``), with ``seq`` = the current generation + 1;
2. the aliases themselves (``previous-champion`` first, then ``champion``, then ``challenger``);
3. ``tide.ops.applied`` = ``seq``.
The generation is the highest ``seq`` recorded. An operation recorded but not applied (its writer
died between 1 and 3) is applied again by the next writer (``roll_forward``): its alias writes are
idempotent. This module is not a lock: the one alias writer (tide/ops/aliases.py ``AliasOwner``)
holds its lock around every read-decide-apply, so no two operations ever share a ``seq``.
Records from before generations (``tide.op.<microseconds>``) are read as history before
generation 1. A mixin of ``Registry``.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from tide.contracts import CHALLENGER, CHAMPION, OP_TAG_PREFIX, PREVIOUS_CHAMPION

SEQ_PREFIX = OP_TAG_PREFIX + "g"  # sorts after the legacy timestamp keys (digits)
APPLIED_TAG = "tide.ops.applied"
LEDGER_ALIASES = (PREVIOUS_CHAMPION, CHAMPION, CHALLENGER)  # the order they are written in


def seq_key(seq: int) -> str:
    return f"{SEQ_PREFIX}{seq:09d}"


@dataclass(frozen=True)
class AliasState:
    """The aliases and the ledger's head, read in one registry call."""

    generation: int = 0
    applied: int = 0
    aliases: dict[str, int] = field(default_factory=dict)
    last: dict | None = None  # the record of operation ``generation``

    @property
    def champion(self) -> int | None:
        return self.aliases.get(CHAMPION)

    @property
    def previous(self) -> int | None:
        return self.aliases.get(PREVIOUS_CHAMPION)

    @property
    def challenger(self) -> int | None:
        return self.aliases.get(CHALLENGER)

    def to_dict(self) -> dict:
        return {"generation": self.generation, "champion": self.champion, "previous": self.previous,
                "challenger": self.challenger}


def _records(tags: dict[str, str]) -> list[dict]:
    legacy = [json.loads(tags[k]) for k in sorted(tags) if k.startswith(OP_TAG_PREFIX)
              and not k.startswith(SEQ_PREFIX)]
    return legacy + [json.loads(tags[k]) for k in sorted(tags) if k.startswith(SEQ_PREFIX)]


class Ledger:
    """Reading the ledger's head and history; applying one operation (the caller holds the lock)."""

    def _model_aliases_and_tags(self) -> tuple[dict[str, int], dict[str, str]]:
        from mlflow.exceptions import MlflowException
        with self._guard("read aliases and operations"):
            try:
                model = self.client.get_registered_model(self.model_name)
            except MlflowException as exc:
                if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                    return {}, {}
                raise
        return {a: int(v) for a, v in model.aliases.items()}, dict(model.tags)

    def alias_state(self) -> AliasState:
        aliases, tags = self._model_aliases_and_tags()
        keys = sorted(k for k in tags if k.startswith(SEQ_PREFIX))
        if not keys:
            return AliasState(aliases=aliases)
        last = json.loads(tags[keys[-1]])
        applied = int(tags.get(APPLIED_TAG, "0") or 0)
        return AliasState(int(last["seq"]), applied, aliases, last)

    def operations(self) -> list[dict]:
        """Recorded promote/rollback operations, oldest first."""
        return _records(self._model_aliases_and_tags()[1])

    def roll_forward(self, state: AliasState) -> AliasState:
        """Apply the last operation again if its writer died before marking it applied."""
        if state.last is None or state.applied >= state.generation:
            return state
        self._write_ledger_aliases(state.last["aliases"], state.aliases)
        self._mark_applied(state.generation)
        return self.alias_state()

    def apply_operation(self, state: AliasState, op: str, actor: str, old: int | None, new: int | None,
                        aliases: dict[str, int | None], reason: str = "", **extra) -> dict:
        """Record operation ``state.generation + 1`` leaving ``aliases``, then write them."""
        seq = state.generation + 1
        record = {"seq": seq, "op": op, "actor": actor, "from": old, "to": new, "reason": reason[:1000],
                  "at_s": round(time.time(), 3), **extra,
                  "aliases": {a: aliases.get(a) for a in LEDGER_ALIASES}}
        with self._guard(f"record {op}"):
            self._ensure_model()
            self.client.set_registered_model_tag(self.model_name, seq_key(seq), json.dumps(record))
        self._write_ledger_aliases(record["aliases"], state.aliases)
        self._mark_applied(seq)
        return record

    def _write_ledger_aliases(self, wanted: dict[str, int | None], current: dict[str, int]) -> None:
        for alias in LEDGER_ALIASES:
            version = wanted.get(alias)
            if version is None:
                if alias in current:
                    self.delete_alias(alias)
            elif current.get(alias) != version:
                self.set_alias(alias, version)

    def _mark_applied(self, seq: int) -> None:
        with self._guard("mark operation applied"):
            self.client.set_registered_model_tag(self.model_name, APPLIED_TAG, str(seq))
