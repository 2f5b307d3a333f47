"""A thin facade over MLflow tracking and the MLflow model registry for drafter versions.

Every drafter TIDE may serve is a version of one registered model (``registry.
registered_model_name``); its files are the artifact folder ``drafter/`` of the MLflow run that
produced it (a retrain, or the bootstrap of the static drafter), under the configured artifact
root. ``Registry`` is one object made of one part per responsibility:

| module | what |
| --- | --- |
| ``store.py`` | connection, experiment, artifact root, errors (``RegistryError``, ``UntrustedVersion``) |
| ``runs.py`` | runs (``RetrainRun``), registering a version, bootstrap, reaping half-registered ones |
| ``versions.py`` | reading versions and aliases, promote / rollback |
| ``ledger.py`` | the alias ledger: numbered operations written ahead of the aliases they move |
| ``artifacts.py`` | where a version's files may come from, verified download into the local cache |

Every MLflow or storage failure surfaces as ``RegistryError`` naming the tracking URI; a version
whose record or files cannot be trusted raises ``UntrustedVersion`` (the registry answered: the
version is refused, the registry is not unreachable).
"""
from __future__ import annotations

from tide.registry.artifacts import ARTIFACT_PATH, Artifacts, folder_digest, source_problem, tag_problem
from tide.registry.ledger import AliasState, Ledger
from tide.registry.runs import DrafterArtifact, RetrainRun, Runs, code_version
from tide.registry.store import ChecksumError, RegistryError, Store, UntrustedVersion
from tide.registry.versions import VersionInfo, Versions

__all__ = ["ARTIFACT_PATH", "AliasState", "ChecksumError", "DrafterArtifact", "Registry", "RegistryError",
           "RetrainRun", "UntrustedVersion", "VersionInfo", "code_version", "folder_digest", "source_problem",
           "tag_problem"]


class Registry(Runs, Versions, Ledger, Artifacts, Store):
    """Drafter versions of one registered model, plus the experiment their runs live in."""
