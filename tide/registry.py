"""A thin facade over MLflow tracking and the MLflow model registry for drafter versions.

Every drafter TIDE may serve is a version of one registered model (``registry.
registered_model_name``); its files are the artifact folder ``drafter/`` of the MLflow run that
produced it (a retrain, or the bootstrap of the static drafter). Aliases say what each version is
for: ``champion`` (what engines serve), ``challenger`` (newest candidate), ``previous-champion``
(where ``rollback`` goes).

Registering a version (``register``), in this order so that a process killed at any point leaves
no version an engine could pick up:
1. the run's artifacts are fully logged first (``RetrainRun.log_drafter``: files + folder digest);
2. the version is created with all its tags in one store transaction, tagged
   ``tide.registration=pending``;
3. the alias is set, then the tag becomes ``complete``; if step 3 fails the version is deleted.
A version left pending by a killed process is deleted by ``reap_incomplete`` (run at the start of
every retrain), which also marks that process's RUNNING run KILLED. Liveness is checked by the
host and pid recorded on the run; for another host, by age (``stale_after_s``).

Every MLflow or storage failure surfaces as ``RegistryError`` naming the tracking URI.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

from tide.config import RegistryConfig
from tide.contracts import (
    CHALLENGER,
    CHAMPION,
    OP_TAG_PREFIX,
    PREVIOUS_CHAMPION,
    TAG_CHECKSUM,
    TAG_CODE,
    TAG_HOST,
    TAG_KIND,
    TAG_PARENT,
    TAG_PID,
    TAG_REGISTRATION,
    TAG_ROLLED_BACK,
    TAG_SIM_ACCEPT,
    TAG_VOCAB,
    TAG_WEIGHTS_SHA,
)
from tide.drafter.artifact import WEIGHTS, file_sha256, read_metadata

log = logging.getLogger(__name__)

ARTIFACT_PATH = "drafter"


class RegistryError(RuntimeError):
    """The registry could not do what was asked; the message says what and where."""


class ChecksumError(RegistryError):
    """A downloaded version's files do not match the digest recorded at registration."""


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


@dataclass(frozen=True)
class DrafterArtifact:
    """Where a run's drafter folder was logged and what it hashes to."""

    run_id: str
    uri: str
    checksum: str
    weights_sha256: str
    vocab_mapping: str


def folder_digest(folder: Path) -> str:
    """sha256 over the sorted ``relative-path<TAB>file-sha256`` lines of every file in ``folder``."""
    folder = Path(folder)
    lines = sorted(f"{p.relative_to(folder).as_posix()}\t{file_sha256(p)}"
                   for p in folder.rglob("*") if p.is_file())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def code_version() -> str:
    """Git commit of the TIDE checkout (``TIDE_CODE_VERSION`` wins), else the package version."""
    if os.environ.get("TIDE_CODE_VERSION"):
        return os.environ["TIDE_CODE_VERSION"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"tide-{version('tide')}"
    except PackageNotFoundError:
        return "unknown"


from tide.process import pid_alive as _pid_alive  # noqa: E402


class RetrainRun:
    """An open MLflow run; create with ``Registry.start_run`` and close with ``finish``."""

    def __init__(self, registry: "Registry", run_id: str, artifact_uri: str) -> None:
        self._registry = registry
        self.run_id = run_id
        self.artifact_uri = artifact_uri

    def log_params(self, params: Mapping[str, object]) -> None:
        from mlflow.entities import Param
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        with self._registry._guard("log params"):
            for i in range(0, len(items), 100):
                self._registry.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        self._log([(k, float(v), step) for k, v in metrics.items()])

    def log_series(self, key: str, values: list[float], first_step: int = 1) -> None:
        """A curve (e.g. the train loss per optimizer step) as one metric with steps."""
        self._log([(key, float(v), first_step + i) for i, v in enumerate(values)])

    def _log(self, rows: list[tuple[str, float, int]]) -> None:
        from mlflow.entities import Metric
        now_ms = int(time.time() * 1000)
        metrics = [Metric(k, v, now_ms, s) for k, v, s in rows]
        with self._registry._guard("log metrics"):
            for i in range(0, len(metrics), 1000):
                self._registry.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def set_tags(self, tags: Mapping[str, object]) -> None:
        from mlflow.entities import RunTag
        with self._registry._guard("set run tags"):
            self._registry.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_json(self, name: str, payload: object) -> None:
        with self._registry._guard(f"log {name}"):
            self._registry.client.log_text(self.run_id, json.dumps(payload, indent=1), name)

    def log_drafter(self, folder: Path) -> DrafterArtifact:
        """Log the drafter folder as ``drafter/`` and return its digests (step 1 of registering)."""
        folder = Path(folder)
        meta = read_metadata(folder)
        weights = file_sha256(folder / WEIGHTS)
        if meta.get("sha256") not in (None, weights):
            raise RegistryError(f"{folder}: tide.json sha256 does not match {WEIGHTS}")
        digest = folder_digest(folder)
        with self._registry._guard("log drafter artifact"):
            self._registry.client.log_artifacts(self.run_id, str(folder), ARTIFACT_PATH)
        self.set_tags({TAG_CHECKSUM: digest, TAG_WEIGHTS_SHA: weights})
        return DrafterArtifact(self.run_id, f"{self.artifact_uri.rstrip('/')}/{ARTIFACT_PATH}",
                               digest, weights, str(meta.get("vocab_mapping", "")))

    def finish(self, status: str = "FINISHED") -> None:
        """FINISHED | FAILED | KILLED."""
        with self._registry._guard("end run"):
            self._registry.client.set_terminated(self.run_id, status=status)


class Registry:
    """Drafter versions of one registered model, plus the experiment their runs live in."""

    def __init__(self, config: RegistryConfig, home: Path) -> None:
        self.config = config
        self.home = Path(home)
        self.model_name = config.registered_model_name
        self.tracking_uri = config.tracking_uri or f"sqlite:///{self.home / 'mlflow' / 'mlflow.db'}"
        self.registry_uri = config.registry_uri or self.tracking_uri
        self.cache_dir = Path(config.cache_dir) if config.cache_dir else self.home / "registry-cache"
        self._check_reachable()
        # progress bars of every download would flood service logs
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        from mlflow import MlflowClient
        with self._guard("connect"):
            self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)
            self.experiment_id = self._experiment_id()

    @classmethod
    def from_config(cls, cfg) -> "Registry":
        """From a whole ``TideConfig``."""
        return cls(cfg.registry, cfg.home_path)

    # --- plumbing ---------------------------------------------------------------------------
    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Turn MLflow, database and I/O failures into RegistryError naming the store."""
        try:
            yield
        except RegistryError:
            raise
        except Exception as exc:  # MlflowException, sqlalchemy, requests, OSError...
            raise RegistryError(f"MLflow at {self.tracking_uri}: {what} failed: "
                                f"{type(exc).__name__}: {exc}") from exc

    def _check_reachable(self) -> None:
        uri = self.tracking_uri
        if uri.startswith("sqlite:///"):
            db = Path(uri[len("sqlite:///"):])
            try:
                db.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RegistryError(f"MLflow store {uri}: cannot create {db.parent}: {exc}") from exc
        elif uri.startswith(("http://", "https://")):
            # MLflow's own client retries for minutes by default: bound it (operator env wins)
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, self.config.http_timeout_s))))
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(self.config.http_max_retries))
            try:
                with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=self.config.http_timeout_s):
                    pass
            except (urllib.error.URLError, OSError, ValueError) as exc:
                raise RegistryError(f"MLflow tracking server {uri} is unreachable: {exc}") from exc

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException
        name = self.config.experiment_name
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = self.config.artifact_location or (self.home / "mlflow" / "artifacts").resolve().as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created concurrently by another process
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def _ensure_model(self) -> None:
        from mlflow.exceptions import MlflowException
        try:
            self.client.create_registered_model(self.model_name, description="TIDE EAGLE3 drafters")
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise

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

    # --- runs and registration --------------------------------------------------------------
    def start_run(self, run_name: str, tags: Mapping[str, object] | None = None) -> RetrainRun:
        """A new run in the experiment, tagged with this process (for ``reap_incomplete``)."""
        all_tags = {TAG_HOST: socket.gethostname(), TAG_PID: os.getpid(), TAG_CODE: code_version(),
                    **(tags or {})}
        with self._guard("create run"):
            run = self.client.create_run(self.experiment_id, run_name=run_name,
                                         tags={k: str(v) for k, v in all_tags.items()})
        return RetrainRun(self, run.info.run_id, run.info.artifact_uri)

    def register(self, artifact: DrafterArtifact, tags: Mapping[str, object],
                 alias: str | None = CHALLENGER, description: str = "") -> VersionInfo:
        """Create a version from a logged drafter and point ``alias`` at it (steps in the module doc)."""
        all_tags = {**{k: str(v) for k, v in tags.items()}, TAG_CHECKSUM: artifact.checksum,
                    TAG_WEIGHTS_SHA: artifact.weights_sha256, TAG_VOCAB: artifact.vocab_mapping,
                    TAG_REGISTRATION: "pending"}
        with self._guard("register version"):
            self._ensure_model()
            mv = self.client.create_model_version(self.model_name, source=artifact.uri,
                                                  run_id=artifact.run_id, tags=all_tags,
                                                  description=description)
        try:
            with self._guard(f"finish registering version {mv.version}"):
                if alias:
                    self._write_alias(alias, str(mv.version))
                self.client.set_model_version_tag(self.model_name, mv.version, TAG_REGISTRATION, "complete")
        except BaseException:
            self._delete_quietly(int(mv.version))
            raise
        return self.get_version(int(mv.version))

    def _delete_quietly(self, version: int) -> None:
        try:
            self.client.delete_model_version(self.model_name, str(version))
        except Exception as exc:  # reap_incomplete removes it later
            log.warning("registry: could not delete half-registered version %s: %s", version, exc)

    def ensure_bootstrap(self, static_path: Path) -> VersionInfo | None:
        """When the registered model has no version: register ``static_path`` as the first one,
        tagged static, alias champion. Returns the champion (None if versions exist but none is)."""
        if self.list_versions(include_incomplete=True, with_run=False):
            return self.get_alias(CHAMPION)
        meta = read_metadata(static_path)
        run = self.start_run("bootstrap-static", {TAG_KIND: "static"})
        try:
            run.log_params({"source_path": str(static_path), "target": meta.get("target", "")})
            sim = meta.get("heldout_sim_accept_length")
            if sim is not None:
                run.log_metrics({"sim_accept_length": float(sim)})
            artifact = run.log_drafter(static_path)
            tags = {TAG_KIND: "static", TAG_PARENT: "", TAG_CODE: code_version()}
            if sim is not None:
                tags[TAG_SIM_ACCEPT] = sim
            info = self.register(artifact, tags, alias=CHAMPION,
                                 description="static pre-trained drafter (ShareGPT English)")
        except BaseException:
            run.finish("FAILED")
            raise
        run.finish("FINISHED")
        # two processes bootstrapping at once (engine and retrain job) both register: keep the
        # lowest static version; both sides reach the same answer
        first = min((v for v in self.list_versions(with_run=False) if v.kind == "static"),
                    key=lambda v: v.version)
        if first.version != info.version:
            self.set_alias(CHAMPION, first.version)  # before deleting ours: champion never vanishes
            self.delete_version(info.version)
            return self.get_version(first.version)
        log.info("registry: bootstrapped %s version %d (static) as champion", self.model_name, info.version)
        return info

    def reap_incomplete(self) -> list[int]:
        """Delete versions left pending by dead processes and mark their RUNNING runs KILLED."""
        deleted = []
        with self._guard("reap incomplete registrations"):
            host, now_s = socket.gethostname(), time.time()

            def dead(tags: Mapping[str, str], started_s: float) -> bool:
                if tags.get(TAG_HOST) == host and tags.get(TAG_PID, "").isdigit():
                    return not _pid_alive(int(tags[TAG_PID]))
                return now_s - started_s > self.config.stale_after_s

            for info in self.list_versions(include_incomplete=True, with_run=False):
                if info.complete:
                    continue
                run_tags = {}
                if info.run_id:
                    try:
                        run_tags = self.client.get_run(info.run_id).data.tags
                    except Exception:
                        pass
                if dead(run_tags, info.created_at_s):
                    self.client.delete_model_version(self.model_name, str(info.version))
                    deleted.append(info.version)
            for run in self.client.search_runs([self.experiment_id], "attributes.status = 'RUNNING'"):
                if dead(run.data.tags, run.info.start_time / 1000.0):
                    self.client.set_terminated(run.info.run_id, status="KILLED")
                    log.info("registry: marked run %s KILLED (its process is gone)", run.info.run_id)
        if deleted:
            log.warning("registry: deleted half-registered versions %s", deleted)
        return deleted

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

    # --- artifacts --------------------------------------------------------------------------
    def download(self, version: int, cache_dir: Path | None = None) -> Path:
        """The version's drafter folder in a local cache, verified against its recorded digest.

        Steps: reuse ``<cache>/<model>/v<version>-<digest>`` if it still verifies; else download
        into a temporary sibling, check the folder digest and weights sha256, rename into place.
        """
        info = self.get_version(version)
        if not info.checksum:
            raise ChecksumError(f"version {version} has no recorded checksum; refusing it")
        root = Path(cache_dir or self.cache_dir) / self.model_name
        dest = root / f"v{version}-{info.checksum[:16]}"
        if dest.is_dir():
            if folder_digest(dest) == info.checksum:
                return dest
            shutil.rmtree(dest, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version}.", dir=root))
        try:
            with self._guard(f"download version {version}"):
                if info.run_id:
                    self.client.download_artifacts(info.run_id, ARTIFACT_PATH, str(tmp))
                else:
                    import mlflow.artifacts
                    mlflow.artifacts.download_artifacts(artifact_uri=info.source, dst_path=str(tmp),
                                                        tracking_uri=self.tracking_uri)
            got = tmp / ARTIFACT_PATH
            actual = folder_digest(got) if got.is_dir() else "missing"
            if actual != info.checksum:
                raise ChecksumError(f"version {version}: downloaded files hash to {actual}, "
                                    f"registered {info.checksum}")
            weights = info.tags.get(TAG_WEIGHTS_SHA)
            if weights and file_sha256(got / WEIGHTS) != weights:
                raise ChecksumError(f"version {version}: {WEIGHTS} sha256 differs from the registered one")
            try:
                os.replace(got, dest)
            except OSError:  # another process put the same version there first
                if not (dest.is_dir() and folder_digest(dest) == info.checksum):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest
