"""MLflow runs and registration: what a retrain (or the static bootstrap) writes.

Registering a version (``register``), in this order so that a process killed at any point leaves
no version an engine could pick up:
1. the run's artifacts are fully logged first (``RetrainRun.log_drafter``: files + folder digest);
2. the version is created with all its tags in one store transaction, tagged
   ``tide.registration=pending``;
3. the alias is set, then the tag becomes ``complete``; if step 3 fails the version is deleted.
A version left pending by a killed process is deleted by ``reap_incomplete`` (run at the start of
every retrain), which also marks that process's RUNNING run KILLED. Liveness is checked by the
host and pid recorded on the run; for another host, by age (``stale_after_s``).
A mixin of ``Registry`` (tide/registry/__init__.py).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from tide.contracts import (
    CHALLENGER,
    CHAMPION,
    TAG_CHECKSUM,
    TAG_CODE,
    TAG_HOST,
    TAG_KIND,
    TAG_PARENT,
    TAG_PID,
    TAG_REGISTRATION,
    TAG_SIM_ACCEPT,
    TAG_VOCAB,
    TAG_WEIGHTS_SHA,
)
from tide.drafter.artifact import WEIGHTS, file_sha256, read_metadata
from tide.process import pid_alive
from tide.registry.artifacts import ARTIFACT_PATH, folder_digest, source_problem
from tide.registry.store import RegistryError
from tide.registry.versions import VersionInfo

log = logging.getLogger(__name__)

# a lower static registration still pending after this long is taken for dead (its remaining
# step is one alias write and one tag)
BOOTSTRAP_SETTLE_S = 60.0
BOOTSTRAP_POLL_S = 0.2


@dataclass(frozen=True)
class DrafterArtifact:
    """Where a run's drafter folder was logged and what it hashes to."""

    run_id: str
    uri: str
    checksum: str
    weights_sha256: str
    vocab_mapping: str


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


class RetrainRun:
    """An open MLflow run; create with ``Registry.start_run`` and close with ``finish``."""

    def __init__(self, registry, run_id: str, artifact_uri: str) -> None:
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


class Runs:
    """Starting runs, registering their drafters, bootstrapping and reaping."""

    def start_run(self, run_name: str, tags: Mapping[str, object] | None = None) -> RetrainRun:
        """A new run in the experiment, tagged with this process (for ``reap_incomplete``).
        Refused when its artifacts would land outside the artifact root (an experiment of that
        name created elsewhere): engines would refuse every version it registered."""
        all_tags = {TAG_HOST: socket.gethostname(), TAG_PID: os.getpid(), TAG_CODE: code_version(),
                    **(tags or {})}
        with self._guard("create run"):
            run = self.client.create_run(self.experiment_id, run_name=run_name,
                                         tags={k: str(v) for k, v in all_tags.items()})
        problem = source_problem(f"{run.info.artifact_uri.rstrip('/')}/{ARTIFACT_PATH}", self.artifact_root)
        if problem:
            with self._guard("end refused run"):
                self.client.set_terminated(run.info.run_id, status="FAILED")
            raise RegistryError(f"experiment {self.config.experiment_name}: {problem}; set "
                                "registry.artifact_location to its root or use another experiment_name")
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
        winner = self._settle_bootstrap(info)
        if winner.version == info.version:
            log.info("registry: bootstrapped %s version %d (static) as champion", self.model_name, info.version)
        return winner

    def _settle_bootstrap(self, ours: VersionInfo) -> VersionInfo:
        """Two processes bootstrapping at once (engine and retrain job) both register: the lowest
        static version wins, pending ones included, so both sides reach the same answer even when
        the lower one completes last."""
        deadline_s = time.monotonic() + BOOTSTRAP_SETTLE_S
        while True:
            first = min((v for v in self.list_versions(include_incomplete=True, with_run=False)
                         if v.kind == "static"), key=lambda v: v.version)
            if first.version == ours.version:
                return ours
            if first.complete:
                self.set_alias(CHAMPION, first.version)  # before deleting ours: champion never vanishes
                self.delete_version(ours.version)
                return self.get_version(first.version)
            if time.monotonic() > deadline_s:  # its process died mid-registration: ours stands
                log.warning("registry: static version %d stayed pending; keeping %d as champion",
                            first.version, ours.version)
                return ours
            time.sleep(BOOTSTRAP_POLL_S)

    def reap_incomplete(self) -> list[int]:
        """Delete versions left pending by dead processes and mark their RUNNING runs KILLED."""
        deleted = []
        with self._guard("reap incomplete registrations"):
            host, now_s = socket.gethostname(), time.time()

            def dead(tags: Mapping[str, str], started_s: float) -> bool:
                if tags.get(TAG_HOST) == host and tags.get(TAG_PID, "").isdigit():
                    return not pid_alive(int(tags[TAG_PID]))
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
