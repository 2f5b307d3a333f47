"""Drafter versions and their aliases: reading them, moving ``champion``, recording operations.

Aliases say what each version is for: ``champion`` (what engines serve), ``challenger`` (newest
candidate), ``previous-champion`` (where ``rollback`` goes). ``promote`` and ``rollback`` record
each operation (who, when, from, to, why) as a tag of the registered model, read back by
``operations``. A mixin of ``Registry``: ``self.client``, ``self._guard`` and ``self.model_name``
come from tide/registry/store.py.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Mapping

from tide.contracts import (
    CHALLENGER,
    CHAMPION,
    OP_TAG_PREFIX,
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

    def promote(self, version: int, actor: str, reason: str = "") -> tuple[int | None, int]:
        """champion -> ``version``; the old champion becomes previous-champion; a challenger
        that is promoted loses that alias. Recorded as an operation. Returns (old, new)."""
        info = self.get_version(version)
        if not info.complete:
            raise RegistryError(f"version {version} is not completely registered")
        current = self.aliases()
        old = current.get(CHAMPION)
        if old != version:
            if old is not None:
                self.set_alias(PREVIOUS_CHAMPION, old)
            self.set_alias(CHAMPION, version)
        if current.get(CHALLENGER) == version:
            self.delete_alias(CHALLENGER)
        self._record("promote", actor, old, version, reason)
        return old, version

    def rollback(self, actor: str, reason: str = "") -> tuple[int, int]:
        """champion -> previous-champion (which is then cleared, so a rollback is never undone
        by a second one). Returns (from, to)."""
        current = self.aliases()
        target, old = current.get(PREVIOUS_CHAMPION), current.get(CHAMPION)
        if target is None:
            raise RegistryError("no previous champion to roll back to")
        self.set_alias(CHAMPION, target)
        self.delete_alias(PREVIOUS_CHAMPION)
        if old is not None:
            self.set_version_tag(old, TAG_ROLLED_BACK, reason or "rollback")
        self._record("rollback", actor, old, target, reason)
        return old, target

    def _record(self, op: str, actor: str, old: int | None, new: int, reason: str) -> None:
        now = time.time()
        value = json.dumps({"op": op, "actor": actor, "from": old, "to": new, "reason": reason[:1000],
                            "at_s": round(now, 3)})
        with self._guard(f"record {op}"):
            self.client.set_registered_model_tag(self.model_name, f"{OP_TAG_PREFIX}{int(now * 1e6):017d}", value)

    def operations(self) -> list[dict]:
        """Recorded promote/rollback operations, oldest first."""
        from mlflow.exceptions import MlflowException
        with self._guard("read operations"):
            try:
                tags = self.client.get_registered_model(self.model_name).tags
            except MlflowException as exc:
                if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                    return []
                raise
        return [json.loads(tags[k]) for k in sorted(tags) if k.startswith(OP_TAG_PREFIX)]

    def delete_version(self, version: int) -> None:
        with self._guard(f"delete version {version}"):
            self.client.delete_model_version(self.model_name, str(version))
