"""A version's files: where they may come from, and downloading them verified into a local cache.

Everything a version's record says is checked before it is used, since whoever can write to the
registry could write anything there (``trust_problem``):
1. the checksum tag (folder digest) and weights tag are 64 lower-case hex characters: the digest
   names the cache folder, so it must be one before it becomes part of a path;
2. the source lies under the artifact root (same scheme and authority, no ``.``/``..`` segment,
   no query; for ``file:`` also after resolving links): files are never read from elsewhere;
3. the listed files add up to at most ``max_artifact_bytes`` and ``MAX_ARTIFACT_FILES`` entries.
``download`` then fetches the source into a temporary sibling of the cache folder, refuses
links and other non-regular files, checks the folder digest and the weights sha256, and renames
it into place. Any of these failing raises ``UntrustedVersion`` (a ``ChecksumError`` for a digest
mismatch): the engine refuses that version once and does not retry it.
A mixin of ``Registry`` (tide/registry/__init__.py).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tide.contracts import TAG_WEIGHTS_SHA
from tide.drafter.artifact import WEIGHTS, file_sha256
from tide.registry.store import ChecksumError, UntrustedVersion

ARTIFACT_PATH = "drafter"
MAX_ARTIFACT_FILES = 64  # a drafter folder holds a handful of files
_HEX64 = re.compile(r"[0-9a-f]{64}")


def folder_digest(folder: Path) -> str:
    """sha256 over the sorted ``relative-path<TAB>file-sha256`` lines of every file in ``folder``."""
    folder = Path(folder)
    lines = sorted(f"{p.relative_to(folder).as_posix()}\t{file_sha256(p)}"
                   for p in folder.rglob("*") if p.is_file())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _split(uri: str) -> tuple[str, str, str]:
    """(scheme, authority, decoded path); a bare path is a ``file`` URI."""
    parts = urlsplit(uri)
    if not parts.scheme:
        return "file", "", os.path.abspath(uri)
    return parts.scheme.lower(), parts.netloc, unquote(parts.path)


def source_problem(source: str, root: str) -> str | None:
    """Why ``source`` is not a location under ``root`` (None when it is)."""
    if not source:
        return "no artifact source recorded"
    where = f"source {source[:300]!r} is not under the artifact root {root!r}"
    parts = urlsplit(source)
    if parts.query or parts.fragment or "\x00" in source or "\\" in source:
        return where + " (query, fragment or odd characters)"
    scheme, authority, path = _split(source)
    root_scheme, root_authority, root_path = _split(root)
    base = root_path.rstrip("/")
    if (scheme, authority) != (root_scheme, root_authority) or not path.startswith(base + "/"):
        return where
    if any(segment in (".", "..") for segment in path.split("/")):
        return where + " (a '.' or '..' segment)"
    if scheme == "file":
        real, real_base = os.path.realpath(path), os.path.realpath(base)
        if real == real_base or os.path.commonpath([real, real_base]) != real_base:
            return where + f" (it resolves to {real})"
    return None


def tag_problem(checksum: str, weights_sha256: str | None) -> str | None:
    """Why the recorded digests cannot be trusted as names (None when they can)."""
    if not checksum:
        return "no recorded checksum"
    if not _HEX64.fullmatch(checksum):
        return f"checksum tag {checksum[:80]!r} is not 64 hex characters"
    if weights_sha256 and not _HEX64.fullmatch(weights_sha256):
        return f"{TAG_WEIGHTS_SHA} tag {weights_sha256[:80]!r} is not 64 hex characters"
    return None


class Artifacts:
    """``download``: a version's drafter folder, checked and verified, in the local cache."""

    def download(self, version: int, cache_dir: Path | None = None) -> Path:
        """The version's drafter folder in a local cache, verified against its recorded digest.

        Reuses ``<cache>/<model>/v<version>-<digest[:16]>`` if it still verifies; otherwise the
        steps in the module docstring.
        """
        info = self.get_version(version)
        weights = info.tags.get(TAG_WEIGHTS_SHA)
        problem = tag_problem(info.checksum, weights) or source_problem(info.source, self.artifact_root)
        if problem:
            kind = ChecksumError if not info.checksum else UntrustedVersion
            raise kind(f"version {version}: {problem}; refusing it")
        root = Path(cache_dir or self.cache_dir) / self.model_name
        dest = root / f"v{version}-{info.checksum[:16]}"
        if dest.is_dir():
            if folder_digest(dest) == info.checksum:
                return dest
            shutil.rmtree(dest, ignore_errors=True)
        self._check_listing(version, info.source)
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version}.", dir=root))
        try:
            import mlflow.artifacts
            with self._guard(f"download version {version}"):
                mlflow.artifacts.download_artifacts(artifact_uri=info.source, dst_path=str(tmp),
                                                    tracking_uri=self.tracking_uri)
            got = tmp / ARTIFACT_PATH
            odd = [p.name for p in got.rglob("*") if p.is_symlink() or not (p.is_file() or p.is_dir())] \
                if got.is_dir() else []
            if odd:
                raise UntrustedVersion(f"version {version}: links or special files {odd[:5]} in its artifacts")
            actual = folder_digest(got) if got.is_dir() else "missing"
            if actual != info.checksum:
                raise ChecksumError(f"version {version}: downloaded files hash to {actual}, "
                                    f"registered {info.checksum}")
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

    def _check_listing(self, version: int, source: str) -> None:
        """Sizes before bytes: the listed files must fit ``max_artifact_bytes``."""
        import mlflow.artifacts
        limit = self.config.max_artifact_bytes
        total, count, pending = 0, 0, [source]
        with self._guard(f"list the files of version {version}"):
            while pending:
                uri = pending.pop()
                for entry in mlflow.artifacts.list_artifacts(artifact_uri=uri, tracking_uri=self.tracking_uri):
                    count += 1
                    if entry.is_dir:
                        pending.append(f"{uri.rstrip('/')}/{entry.path.rsplit('/', 1)[-1]}")
                    total += int(entry.file_size or 0)
                    if count > MAX_ARTIFACT_FILES or total > limit:
                        raise UntrustedVersion(
                            f"version {version}: its artifacts exceed {MAX_ARTIFACT_FILES} files or "
                            f"registry.max_artifact_bytes ({limit}); refusing it")
