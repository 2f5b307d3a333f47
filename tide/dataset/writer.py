"""Crash-safe Parquet files: written under a hidden temporary name, made durable, then renamed.

Steps for one file:
1. ``OpenFile`` creates ``.<uuid>.tmp`` in the final directory (same filesystem, so the rename
   is atomic) and streams row groups into it as they fill, so memory holds one row group;
2. ``seal`` writes the last row group and the footer, fsyncs the file, renames it to its
   offset-range name and fsyncs the directory (the rename itself must survive a crash);
3. directories created on the way are fsynced into their parents too.
A crash at any point leaves either no visible file or a complete one; ``remove_temporaries``
deletes the leftovers at start-up. An error (a full disk) removes the temporary at once: it
holds user data, and its space is what a full disk needs back.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tide.dataset.schema import COLUMN_COMPRESSION, PARQUET_SCHEMA, STATISTICS_COLUMNS, FileName, Row, rows_to_table


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs_durable(root: Path, relative: str) -> Path:
    """Create ``root/relative`` and fsync every parent whose entry list changed."""
    path = root
    for part in Path(relative).parts:
        child = path / part
        if not child.is_dir():
            child.mkdir(exist_ok=True)
            fsync_dir(path)
        path = child
    return path


def remove_temporaries(data_dir: Path) -> int:
    """Delete half-written files left by a crash; returns how many."""
    count = 0
    for tmp in data_dir.glob("target_model=*/date=*/hour=*/.*.tmp"):
        tmp.unlink(missing_ok=True)
        count += 1
    return count


def write_temporary(table: pa.Table, directory: Path) -> Path:
    """``table`` as a complete, fsynced hidden temporary in ``directory`` (removed on error)."""
    tmp = directory / f".{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as handle:
            pq.write_table(table, handle, compression=COLUMN_COMPRESSION,
                           write_statistics=STATISTICS_COLUMNS, use_dictionary=False,
                           row_group_size=max(1, min(64, table.num_rows)))
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def without_rows(table: pa.Table, request_ids: set[str], captured_until_s: float) -> pa.Table:
    """``table`` less the rows of ``request_ids`` and those captured at or before the cut."""
    keep = pc.greater(table.column("finished_at_s"), captured_until_s)
    if request_ids:
        keep = pc.and_(keep, pc.invert(pc.is_in(table.column("request_id"),
                                                pa.array(sorted(request_ids), pa.string()))))
    return table.filter(keep)


@dataclass
class FileStats:
    """What the index keeps per file."""

    path: str  # relative to data_dir
    target_model: str
    topic: str
    partition: int
    first_offset: int
    last_offset: int
    rows: int = 0
    requests: int = 0
    tokens: int = 0
    generated_tokens: int = 0
    min_time_s: float = float("inf")
    max_time_s: float = float("-inf")
    bytes: int = 0
    created_at_s: float = 0.0


@dataclass
class OpenFile:
    """One Parquet file being filled with rows of a single topic partition and directory."""

    data_dir: Path
    relative_dir: str
    topic: str
    partition: int
    row_group_rows: int
    row_group_bytes: int
    rows: int = 0
    nbytes: int = 0
    first_offset: int = -1
    last_offset: int = -1
    tokens: int = 0
    generated_tokens: int = 0
    min_time_s: float = float("inf")
    max_time_s: float = float("-inf")
    request_ids: set[str] = field(default_factory=set)
    target_model: str = ""
    _buffer: list[Row] = field(default_factory=list)
    _buffer_bytes: int = 0
    _writer: pq.ParquetWriter | None = None
    _handle: object = None
    _tmp: Path | None = None
    _tag: str = ""

    def add(self, row: Row) -> None:
        if self.first_offset < 0:
            self.first_offset = row.offset
            self._tag = FileName.tag_for(row.record.request_id, row.record.chunk_index,
                                         row.timestamp_ms)
        self.last_offset = max(self.last_offset, row.offset)
        rec = row.record
        self.target_model = rec.target_model_id
        self.rows += 1
        self.nbytes += row.nbytes
        self.tokens += rec.num_tokens
        self.generated_tokens += int(rec.loss_mask.sum())
        self.min_time_s = min(self.min_time_s, rec.finished_at_s)
        self.max_time_s = max(self.max_time_s, rec.finished_at_s)
        self.request_ids.add(rec.request_id)
        self._buffer.append(row)
        self._buffer_bytes += row.nbytes
        if len(self._buffer) >= self.row_group_rows or self._buffer_bytes >= self.row_group_bytes:
            self._write_buffer()

    def _write_buffer(self) -> None:
        if not self._buffer:
            return
        if self._writer is None:
            directory = make_dirs_durable(self.data_dir, self.relative_dir)
            self._tmp = directory / f".{uuid.uuid4().hex}.tmp"
            self._handle = open(self._tmp, "wb")
            self._writer = pq.ParquetWriter(
                self._handle, PARQUET_SCHEMA, compression=COLUMN_COMPRESSION,
                write_statistics=STATISTICS_COLUMNS, use_dictionary=False,
                data_page_size=8 * 1024 * 1024)
        self._writer.write_table(rows_to_table(self._buffer), row_group_size=len(self._buffer))
        self._buffer = []
        self._buffer_bytes = 0
        # start writeback of this row group now (asynchronously), so the fsync at seal time
        # finds little left to do instead of stalling on the whole file
        self._handle.flush()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def seal(self, created_at_s: float) -> FileStats:
        """Finish, fsync, rename to the offset-range name, fsync the directory."""
        self.finish()
        return self.stats(self.publish(), created_at_s)

    @property
    def temporary(self) -> Path | None:
        return self._tmp

    def finish(self) -> Path:
        """Write the last row group and the footer, fsync: the temporary is a complete file."""
        self._write_buffer()
        assert self._writer is not None and self._tmp is not None, "sealing an empty file"
        self._writer.close()
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        self._writer = self._handle = None
        return self._tmp

    def publish(self, replacement: Path | None = None) -> Path:
        """Rename the finished temporary (or ``replacement``, a filtered copy of it, which
        supersedes it) to the offset-range name and fsync the directory; returns the path."""
        name = FileName(self.topic, self.partition, self.first_offset, self.last_offset, self._tag)
        final = self._tmp.parent / str(name)
        try:
            os.rename(replacement or self._tmp, final)
        except BaseException:
            if replacement is not None:
                replacement.unlink(missing_ok=True)
            raise
        if replacement is not None:
            self._tmp.unlink(missing_ok=True)
        self._tmp = None
        fsync_dir(final.parent)
        return final

    def stats(self, final: Path, created_at_s: float) -> FileStats:
        return FileStats(
            path=str(final.relative_to(self.data_dir)), target_model=self.target_model,
            topic=self.topic, partition=self.partition, first_offset=self.first_offset,
            last_offset=self.last_offset, rows=self.rows, requests=len(self.request_ids),
            tokens=self.tokens, generated_tokens=self.generated_tokens,
            min_time_s=self.min_time_s, max_time_s=self.max_time_s,
            bytes=final.stat().st_size, created_at_s=created_at_s)

    def discard(self) -> None:
        """Drop the half-written file (its offsets were not committed; they will be replayed).
        Closing may fail (a full disk refuses the footer); the handle is closed and the file
        unlinked regardless: an open handle would keep the space of the unlinked file."""
        for close in (self._writer, self._handle):
            try:
                if close is not None:
                    close.close()
            except (OSError, pa.ArrowException):
                pass
        self._writer = self._handle = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None
        self._buffer = []
