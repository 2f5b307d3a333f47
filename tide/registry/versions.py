"""Drafter versions and their aliases: reading them, moving ``champion``, recording operations.

Aliases say what each version is for: ``champion`` (what engines serve), ``challenger`` (newest
candidate), ``previous-champion`` (where ``rollback`` goes). ``promote`` and ``rollback`` are
operations of the alias ledger (tide/registry/ledger.py: who, when, from, to, why, numbered by
generation), applied only by the one alias writer (tide/ops/aliases.py). A mixin of ``Registry``:
``self.client``, ``self._guard`` and ``self.model_name`` come from tide/registry/store.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping

from tide.contracts import (
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION,
    TAG_CHECKSUM,
    TAG_KIND,
    TAG_PARENT,
    TAG_REGISTRATION,
    TAG_ROLLED_BACK,
    TAG_SIM_ACCEPT,
)
from tide.registry.store import RegistryError


@dataclass(frozen=True)
class VersionInfo:
    """One registered drafter version, with its run's latest metrics and params."""

    name: str
    version: int
    aliases: tuple[str, ...]
    tags: Mapping[str, str]
    run_id: str | None
    source: str
    created_at_s: float
    description: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.tags.get(TAG_KIND, "")

    @property
    def complete(self) -> bool:
        return self.tags.get(TAG_REGISTRATION, "complete") == "complete"

    @property
    def parent_version(self) -> str:
        return self.tags.get(TAG_PARENT, "")

    @property
    def checksum(self) -> str:
        return self.tags.get(TAG_CHECKSUM, "")

    @property
    def sim_accept_length(self) -> float | None:
        value = self.tags.get(TAG_SIM_ACCEPT)
        return float(value) if value not in (None, "") else None


class Versions:
    """Reading versions and aliases; promote, rollback and the operations they record."""

    def _info(self, mv, aliases: Mapping[int, list[str]] | None = None, with_run: bool = True) -> VersionInfo:
        version = int(mv.version)
        if aliases is None:
            aliases = self._alias_map()
        metrics, params = {}, {}
        if with_run and mv.run_id:
            try:
                data = self.client.get_run(mv.run_id).data
                metrics, params = dict(data.metrics), dict(data.params)
            except Exception:  # a deleted run keeps the version usable
                pass
        return VersionInfo(name=mv.name, version=version, aliases=tuple(sorted(aliases.get(version, []))),
                           tags=dict(mv.tags or {}), run_id=mv.run_id or None, source=mv.source,
                           created_at_s=(mv.creation_timestamp or 0) / 1000.0,
                           description=mv.description or "", metrics=metrics, params=params)

    def _alias_map(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for alias, version in self.aliases().items():
            out.setdefault(version, []).append(alias)
        return out

    # --- reading ----------------------------------------------------------------------------
    def aliases(self) -> dict[str, int]:
        from mlflow.exceptions import MlflowException
        with self._guard("read aliases"):
            try:
                return {a: int(v) for a, v in self.client.get_registered_model(self.model_name).aliases.items()}
            except MlflowException as exc:
                if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                    return {}
                raise

    def get_version(self, version: int) -> VersionInfo:
        from mlflow.exceptions import MlflowException
        with self._guard(f"read version {version}"):
            try:
                mv = self.client.get_model_version(self.model_name, str(version))
            except MlflowException as exc:
                if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                    raise RegistryError(f"{self.model_name} has no version {version}") from exc
                raise
            return self._info(mv)

    def get_alias(self, alias: str) -> VersionInfo | None:
        version = self.aliases().get(alias)
        return None if version is None else self.get_version(version)

    def list_versions(self, include_incomplete: bool = False, with_run: bool = True) -> list[VersionInfo]:
        """Versions newest first, with aliases, tags and (``with_run``) their run's metrics."""
        with self._guard("list versions"):
            found = self.client.search_model_versions(f"name = '{self.model_name}'")
            aliases = self._alias_map()
            infos = [self._info(mv, aliases, with_run) for mv in found]
        infos = [i for i in infos if include_incomplete or i.complete]
        return sorted(infos, key=lambda i: -i.version)

    # --- aliases and operations -------------------------------------------------------------
    def set_alias(self, alias: str, version: int) -> None:
        with self._guard(f"set alias {alias} -> {version}"):
            self._write_alias(alias, str(version))

    def _write_alias(self, alias: str, version: str, attempts: int = 3) -> None:
        """Two writers may set one alias at once (an engine and a retrain job bootstrapping): the
        SQL store's upsert then fails one of them on the alias key; a retry overwrites cleanly."""
        for attempt in range(attempts):
            try:
                self.client.set_registered_model_alias(self.model_name, alias, version)
                return
            except Exception:  # noqa: BLE001 - re-raised on the last attempt, wrapped by _guard
                if attempt == attempts - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))

    def delete_alias(self, alias: str) -> None:
        from mlflow.exceptions import MlflowException
        with self._guard(f"delete alias {alias}"):
            try:
                self.client.delete_registered_model_alias(self.model_name, alias)
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise

    def set_version_tag(self, version: int, key: str, value: object) -> None:
        with self._guard(f"tag version {version}"):
            self.client.set_model_version_tag(self.model_name, str(version), key, str(value))

    def promote(self, version: int, actor: str, reason: str = "", **extra) -> tuple[int | None, int]:
        """champion -> ``version``; the old champion becomes previous-champion; a challenger
        that is promoted loses that alias. One ledger operation (tide/registry/ledger.py); the
        caller holds the alias lock (tide/ops/aliases.py). Returns (old, new)."""
        info = self.get_version(version)
        if not info.complete:
            raise RegistryError(f"version {version} is not completely registered")
        state = self.roll_forward(self.alias_state())
        old = state.champion
        aliases = {**state.aliases, CHAMPION: version,
                   PREVIOUS_CHAMPION: old if old not in (None, version) else state.previous,
                   CHALLENGER: None if state.challenger == version else state.challenger}
        self.apply_operation(state, "promote", actor, old, version, aliases, reason, **extra)
        return old, version

    def rollback(self, actor: str, reason: str = "", to: int | None = None, **extra) -> tuple[int | None, int]:
        """champion -> previous-champion (or ``to``), and previous-champion is cleared, so a
        rollback is never undone by a second one; the version rolled back from is tagged. One
        ledger operation; the caller holds the alias lock. Returns (from, to)."""
        state = self.roll_forward(self.alias_state())
        target, old = to if to is not None else state.previous, state.champion
        if target is None:
            raise RegistryError("no previous champion to roll back to")
        aliases = {**state.aliases, CHAMPION: target, PREVIOUS_CHAMPION: None}
        self.apply_operation(state, "rollback", actor, old, target, aliases, reason, **extra)
        if old is not None and old != target:
            self.set_version_tag(old, TAG_ROLLED_BACK, reason or "rollback")
        return old, target

    def delete_version(self, version: int) -> None:
        with self._guard(f"delete version {version}"):
            self.client.delete_model_version(self.model_name, str(version))
