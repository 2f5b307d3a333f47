"""Where the dataset's Delta table lives: a URI (a local directory, or ``s3://bucket/prefix``) and
how to reach it.

Storage options are delta-rs's (object_store's) ``AWS_*`` keys: ``ingest.storage_options`` from the
config (endpoint, region, ``AWS_ALLOW_HTTP``: nothing secret), then the same names from the
environment (credentials come only from there: a Kubernetes Secret reference, or the local
stack's environment). TIDE writes and reads data files itself through a pyarrow filesystem built
from the same options, so the log (delta-rs) and the files (pyarrow) always point at one place.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

# the option names read from the environment when the config does not set them
ENV_OPTIONS = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
               "AWS_SESSION_TOKEN", "AWS_ALLOW_HTTP")
TOMBSTONES = "_tide_deleted"  # a small Delta table beside the data (tide/dataset/tombstones.py)


@dataclass(frozen=True)
class Location:
    uri: str  # a local path (absolute after from_uri) or s3://bucket/prefix
    options: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_uri(cls, uri: str | Path, options: dict[str, str] | None = None) -> "Location":
        text = str(uri)
        if text.startswith("file://"):
            text = text[len("file://"):]
        if not is_remote(text):
            text = str(Path(text).expanduser().resolve())
        merged = {k: os.environ[k] for k in ENV_OPTIONS if os.environ.get(k)}
        merged.update({k: str(v) for k, v in (options or {}).items()})
        return cls(text.rstrip("/"), merged if is_remote(text) else {})

    @classmethod
    def from_config(cls, cfg, uri: str | Path | None = None) -> "Location":
        """The table of the whole TideConfig: ``uri`` or ``ingest.data_dir`` or ``<home>/dataset``."""
        chosen = uri or cfg.ingest.data_dir or cfg.home_path / "dataset"
        return cls.from_uri(chosen, cfg.ingest.storage_options)

    @property
    def remote(self) -> bool:
        return is_remote(self.uri)

    def child(self, name: str) -> "Location":
        return Location(f"{self.uri}/{name}", self.options)

    def filesystem(self):
        """(pyarrow filesystem, root path inside it) of the table."""
        from pyarrow import fs

        if not self.remote:
            return fs.LocalFileSystem(), self.uri
        parts = urlsplit(self.uri)
        if parts.scheme not in ("s3", "s3a"):
            raise ValueError(f"dataset URI {self.uri!r}: only local paths and s3:// are supported")
        o = self.options
        endpoint = o.get("AWS_ENDPOINT_URL", "")
        kwargs = {"region": o.get("AWS_REGION") or "us-east-1"}
        if endpoint:
            split = urlsplit(endpoint)
            kwargs.update(endpoint_override=split.netloc or split.path, scheme=split.scheme or "https")
        if o.get("AWS_ACCESS_KEY_ID"):
            kwargs.update(access_key=o["AWS_ACCESS_KEY_ID"], secret_key=o.get("AWS_SECRET_ACCESS_KEY", ""),
                          session_token=o.get("AWS_SESSION_TOKEN") or None)
        # virtual-host addressing needs DNS per bucket; S3-compatible stores serve paths
        return fs.S3FileSystem(force_virtual_addressing=False, **kwargs), parts.netloc + parts.path

    def describe(self) -> str:
        """The URI without credentials (they are never part of it) for logs and lineage."""
        return self.uri


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")
