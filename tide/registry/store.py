"""The connection to MLflow that every part of the registry facade shares.

``Store`` resolves the tracking and registry URIs, the artifact root and the download cache from
``RegistryConfig``, checks that the store is reachable within ``http_timeout_s`` before MLflow's
own client (which retries for minutes by default) is built, and finds or creates the experiment
the runs live in. ``_guard`` turns every MLflow, database and I/O failure into ``RegistryError``
naming the tracking URI, so callers catch one exception type.

The artifact root (``registry.artifact_location``, default ``<home>/mlflow/artifacts``) is the
only place a version's files may come from (tide/registry/artifacts.py checks every source
against it): the experiment is created there, and a run whose artifacts land elsewhere (an
experiment created by someone else) is refused at ``start_run``.
"""
from __future__ import annotations

import logging
import os
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tide.config import RegistryConfig
from tide.redact import redact_url

log = logging.getLogger(__name__)


class RegistryError(RuntimeError):
    """The registry could not do what was asked; the message says what and where."""


class UntrustedVersion(RegistryError):
    """A version's registry record or files may not be served (bad checksum tag, source outside
    the artifact root, files that do not match the recorded digest). Refusing it is final for
    that version: the registry itself answered, so this is not an outage."""


class ChecksumError(UntrustedVersion):
    """A downloaded version's files do not match the digest recorded at registration."""


def default_artifact_root(home: Path) -> str:
    return (Path(home) / "mlflow" / "artifacts").resolve().as_uri()


def default_cache_dir(home: Path) -> Path:
    """Where downloaded versions are kept unless ``registry.cache_dir`` says otherwise."""
    return Path(home) / "registry-cache"


class Store:
    """MLflow client, experiment and paths of one registered model (the base of ``Registry``)."""

    def __init__(self, config: RegistryConfig, home: Path) -> None:
        self.config = config
        self.home = Path(home)
        self.model_name = config.registered_model_name
        self.tracking_uri = config.tracking_uri or f"sqlite:///{self.home / 'mlflow' / 'mlflow.db'}"
        self.registry_uri = config.registry_uri or self.tracking_uri
        self.shown_uri = redact_url(self.tracking_uri)  # what messages and logs name (no password)
        self.cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir(self.home)
        self.artifact_root = config.artifact_location or default_artifact_root(self.home)
        self._check_reachable()
        # progress bars of every download would flood service logs
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        from mlflow import MlflowClient
        with self._guard("connect"):
            self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)
            self.experiment_id = self._experiment_id()

    @classmethod
    def from_config(cls, cfg):
        """From a whole ``TideConfig``."""
        return cls(cfg.registry, cfg.home_path)

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Turn MLflow, database and I/O failures into RegistryError naming the store."""
        try:
            yield
        except RegistryError:
            raise
        except Exception as exc:  # MlflowException, sqlalchemy, requests, OSError...
            raise RegistryError(f"MLflow at {self.shown_uri}: {what} failed: "
                                f"{type(exc).__name__}: {redact_url(str(exc))}") from exc

    def _check_reachable(self) -> None:
        uri = self.tracking_uri
        if uri.startswith("sqlite:///"):
            db = Path(uri[len("sqlite:///"):])
            try:
                db.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RegistryError(f"MLflow store {self.shown_uri}: cannot create {db.parent}: {exc}") from exc
        elif uri.startswith(("http://", "https://")):
            # MLflow's own client retries for minutes by default: bound it (operator env wins)
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, self.config.http_timeout_s))))
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(self.config.http_max_retries))
            try:
                with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=self.config.http_timeout_s):
                    pass
            except (urllib.error.URLError, OSError, ValueError) as exc:
                raise RegistryError(f"MLflow tracking server {self.shown_uri} is unreachable: "
                                    f"{redact_url(str(exc))}") from exc

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException
        name = self.config.experiment_name
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=self.artifact_root)
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
