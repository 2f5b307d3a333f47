"""One data file being filled: rows stream into ``<table>/date=D/hour=H/part-<uuid>.parquet`` as
row groups, so memory holds one row group (on S3, pyarrow uploads it in parts as it goes).

A file is invisible to every reader until its add action is committed to the table log
(tide/dataset/table.py); a file written but never committed (a crash, a lost race, a discarded
batch) is an orphan that VACUUM removes once it is older than the vacuum retention. ``finish``
writes the footer and returns the add action with its statistics; ``discard`` deletes the file
(it holds user data). ``rewrite_without`` makes a filtered copy when rows must not be committed
(a request deleted meanwhile).
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tide.dataset.location import Location
from tide.dataset.schema import (
    COLUMN_COMPRESSION,
    PARQUET_SCHEMA,
    STATISTICS_COLUMNS,
    Row,
    file_stats,
    partition_path,
    rows_to_table,
)
from tide.dataset.table import COUNT_UNITS

log = logging.getLogger(__name__)


def add_counts(total: dict, model: str, counts: dict[str, int]) -> None:
    into = total.setdefault(model, dict.fromkeys(COUNT_UNITS, 0))
    for unit in COUNT_UNITS:
        into[unit] += counts.get(unit, 0)


def table_counts(table: pa.Table) -> dict[str, dict[str, int]]:
    """``tide.counts`` of a file's rows: per target model, rows, requests (last chunks), tokens."""
    import numpy as np

    out: dict[str, dict[str, int]] = {}
    n = table.num_rows
    masks = table.column("loss_mask").combine_chunks()
    flat = pc.list_flatten(masks).to_numpy(zero_copy_only=False).astype(np.int64)
    parents = pc.list_parent_indices(masks).to_numpy(zero_copy_only=False)
    generated = np.bincount(parents, weights=flat, minlength=n) if n else np.zeros(0)
    last = pc.equal(table.column("chunk_index"), pc.subtract(table.column("chunk_count"), 1)).to_pylist()
    tokens = table.column("num_tokens").to_pylist()
    for i, model in enumerate(table.column("target_model_id").to_pylist()):
        add_counts(out, model, {"rows": 1, "requests": int(bool(last[i])), "tokens": tokens[i],
                                "generated_tokens": int(generated[i])})
    return out


@dataclass
class FileOut:
    """A finished file: its add action, what the commit metadata counts, and its request ids."""

    add: object  # deltalake.transaction.AddAction
    counts: dict[str, dict[str, int]]
    request_ids: set[str]
    rows: int
    nbytes: int


@dataclass
class DataFileWriter:
    location: Location
    partition: dict[str, str]  # Delta partition values (tide.dataset.schema.partition_values)
    row_group_rows: int = 64
    row_group_bytes: int = 32 * 1024 * 1024
    rows: int = 0
    nbytes: int = 0
    request_ids: set[str] = field(default_factory=set)
    counts: dict = field(default_factory=dict)
    _buffer: list[Row] = field(default_factory=list)
    _buffer_bytes: int = 0
    _writer: pq.ParquetWriter | None = None
    _stream: object = None
    _stats: list = field(default_factory=list)  # small columns of each row group, for statistics
    relative_path: str = ""

    def add(self, row: Row) -> None:
        rec = row.record
        self.rows += 1
        self.nbytes += row.nbytes
        self.request_ids.add(rec.request_id)
        self._buffer.append(row)
        self._buffer_bytes += row.nbytes
        if len(self._buffer) >= self.row_group_rows or self._buffer_bytes >= self.row_group_bytes:
            self._write_buffer()

    def _open(self) -> None:
        fs, root = self.location.filesystem()
        self.relative_path = f"{partition_path(self.partition)}/part-{uuid.uuid4().hex}.parquet"
        if not self.location.remote:
            fs.create_dir(f"{root}/{partition_path(self.partition)}", recursive=True)
        self._stream = fs.open_output_stream(f"{root}/{self.relative_path}")
        self._writer = pq.ParquetWriter(self._stream, PARQUET_SCHEMA, compression=COLUMN_COMPRESSION,
                                        write_statistics=STATISTICS_COLUMNS, use_dictionary=False,
                                        data_page_size=8 * 1024 * 1024)

    def _write_buffer(self) -> None:
        if not self._buffer:
            return
        if self._writer is None:
            self._open()
        table = rows_to_table(self._buffer)
        self._writer.write_table(table, row_group_size=len(self._buffer))
        self._stats.append(table.drop_columns(["aux_hidden", "final_hidden", "token_ids", "version_changes"]))
        add_counts_all(self.counts, table_counts(table))
        self._buffer, self._buffer_bytes = [], 0

    def finish(self) -> FileOut:
        """Last row group and footer written, the stream closed (uploaded): the file is complete."""
        from deltalake.transaction import AddAction

        self._write_buffer()
        assert self._writer is not None, "finishing an empty file"
        self._writer.close()
        self._stream.close()
        self._writer = self._stream = None
        fs, root = self.location.filesystem()
        size = fs.get_file_info(f"{root}/{self.relative_path}").size
        small = pa.concat_tables(self._stats)
        add = AddAction(self.relative_path, size, dict(self.partition), int(time.time() * 1000), True,
                        file_stats(small))
        return FileOut(add, self.counts, set(self.request_ids), self.rows, size)

    def discard(self) -> None:
        """Drop the file (uncommitted; its offsets will be consumed again). Closing may fail (the
        store refuses the upload); the file is deleted regardless: it holds user data."""
        for close in (self._writer, self._stream):
            try:
                if close is not None:
                    close.close()
            except (OSError, pa.ArrowException):
                pass
        self._writer = self._stream = None
        if self.relative_path:
            delete_file(self.location, self.relative_path)
        self._buffer = []


def add_counts_all(total: dict, counts: dict) -> None:
    for model, c in counts.items():
        add_counts(total, model, c)


def delete_file(location: Location, relative_path: str) -> None:
    fs, root = location.filesystem()
    try:
        fs.delete_file(f"{root}/{relative_path}")
    except FileNotFoundError:
        pass
    except OSError as exc:  # VACUUM removes it later (it is never committed)
        log.warning("dataset: could not delete uncommitted %s: %s", relative_path, exc)


def rewrite_without(location: Location, out: FileOut, request_ids: set[str]) -> tuple[FileOut | None, int]:
    """A copy of ``out``'s file less the rows of ``request_ids`` (None when nothing is left); the
    original is deleted. Returns (copy, rows removed)."""
    fs, root = location.filesystem()
    with fs.open_input_file(f"{root}/{out.add.path}") as handle:
        table = pq.read_table(handle)
    kept = table.filter(pc.invert(pc.is_in(table.column("request_id"), pa.array(sorted(request_ids), pa.string()))))
    delete_file(location, out.add.path)
    if kept.num_rows == 0:
        return None, table.num_rows
    return write_file(location, kept, dict(out.add.partition_values)), table.num_rows - kept.num_rows


def write_file(location: Location, table: pa.Table, partition: dict[str, str]) -> FileOut:
    """``table`` (rows of one partition, PARQUET_SCHEMA) as one complete data file, not committed."""
    from deltalake.transaction import AddAction

    fs, root = location.filesystem()
    folder = partition_path(partition)
    path = f"{folder}/part-{uuid.uuid4().hex}.parquet"
    if not location.remote:
        fs.create_dir(f"{root}/{folder}", recursive=True)
    with fs.open_output_stream(f"{root}/{path}") as stream:
        pq.write_table(table, stream, compression=COLUMN_COMPRESSION, write_statistics=STATISTICS_COLUMNS,
                       use_dictionary=False, row_group_size=max(1, min(64, table.num_rows)))
    size = fs.get_file_info(f"{root}/{path}").size
    add = AddAction(path, size, dict(partition), int(time.time() * 1000), True, file_stats(table))
    return FileOut(add, table_counts(table), set(table.column("request_id").to_pylist()), table.num_rows, size)
