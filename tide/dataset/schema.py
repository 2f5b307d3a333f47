"""Parquet layout of the dataset: one row per record chunk, and where each file lives.

Written down for other tools in ``schemas/parquet.schema.json`` (packaged as ``tide.schemas``) (a test keeps the two equal).

Layout: ``<data_dir>/target_model=<quoted id>/date=YYYY-MM-DD/hour=HH/<file>`` where the date and
hour are the UTC capture time (``finished_at_s``) and ``<file>`` is
``<topic>-p<partition>-<first offset>-<last offset>-<tag>.parquet`` (offsets zero-padded to 20
digits; ``tag`` = 8 hex digits hashed from the first row's request id, chunk index and Kafka
timestamp, so a topic recreated with offsets from 0 never overwrites an older file).
A file holds only offsets of one topic partition, so the offsets on disk (checked against the
request id and chunk index stored there) say exactly which messages are already durable. Files being written are dot-prefixed ``.tmp`` files that no reader
lists. Chunks are stored as they came (not reassembled): a file never waits for a request's
other chunks, and the reader joins them.
"""
from __future__ import annotations

import hashlib
import re
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from tide.records import SCHEMA_VERSION, Record

PARQUET_SCHEMA = pa.schema([
    ("kafka_topic", pa.string()),
    ("kafka_partition", pa.int32()),
    ("kafka_offset", pa.int64()),
    ("kafka_timestamp_ms", pa.int64()),
    ("schema_version", pa.int16()),
    ("request_id", pa.string()),
    ("target_model_id", pa.string()),
    ("drafter_version", pa.string()),
    ("aux_layer_ids", pa.list_(pa.int32())),
    ("workload", pa.string()),
    ("started_at_s", pa.float64()),
    ("finished_at_s", pa.float64()),
    ("ingested_at_s", pa.float64()),
    ("position_start", pa.int32()),
    ("num_tokens", pa.int32()),
    ("request_num_tokens", pa.int32()),
    ("chunk_index", pa.int32()),
    ("chunk_count", pa.int32()),
    ("hidden_size", pa.int32()),
    ("hidden_dtype", pa.string()),
    ("token_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.uint8())),
    ("aux_hidden", pa.binary()),
    ("final_hidden", pa.binary()),
    ("version_changes", pa.list_(pa.struct([("position", pa.int32()), ("drafter_version", pa.string())]))),
])
HIDDEN_COLUMNS = ("aux_hidden", "final_hidden")
# bf16/fp8 activations barely compress; zstd on them costs ingest CPU for ~10 % of bytes
COLUMN_COMPRESSION = {name: ("none" if name in HIDDEN_COLUMNS else "zstd")
                      for name in PARQUET_SCHEMA.names}
STATISTICS_COLUMNS = [n for n in PARQUET_SCHEMA.names if n not in HIDDEN_COLUMNS
                      and n not in ("token_ids", "loss_mask", "aux_layer_ids", "version_changes")]

_FILE_RE = re.compile(r"^(?P<topic>.+)-p(?P<partition>\d+)-(?P<first>\d{20})-(?P<last>\d{20})"
                      r"-(?P<tag>[0-9a-f]{8})\.parquet$")


@dataclass(frozen=True)
class FileName:
    topic: str
    partition: int
    first_offset: int
    last_offset: int
    tag: str

    def __str__(self) -> str:
        return (f"{self.topic}-p{self.partition}-{self.first_offset:020d}-{self.last_offset:020d}"
                f"-{self.tag}.parquet")

    @classmethod
    def parse(cls, name: str) -> "FileName | None":
        match = _FILE_RE.match(name)
        if not match:
            return None
        return cls(match["topic"], int(match["partition"]), int(match["first"]), int(match["last"]),
                   match["tag"])

    @staticmethod
    def tag_for(request_id: str, chunk_index: int, timestamp_ms: int) -> str:
        key = f"{request_id}\0{chunk_index}\0{timestamp_ms}".encode("utf-8", "surrogatepass")
        return hashlib.blake2b(key, digest_size=4).hexdigest()


_MAX_MODEL_DIR_CHARS = 200  # "target_model=" + this stays within a file name's 255 bytes


def partition_dir(target_model_id: str, at_s: float) -> str:
    """Relative hive-style directory for a model and a capture time (UTC). A quoted model id
    longer than 200 characters is cut and ends in ``~`` + 16 hex digits of its hash."""
    t = time.gmtime(at_s)
    model = urllib.parse.quote(target_model_id, safe="")
    if len(model) > _MAX_MODEL_DIR_CHARS:
        digest = hashlib.blake2b(target_model_id.encode(), digest_size=8).hexdigest()
        model = model[:_MAX_MODEL_DIR_CHARS - 17] + "~" + digest
    return f"target_model={model}/date={t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}/hour={t.tm_hour:02d}"


def list_files(data_dir: Path) -> list[Path]:
    """Durable data files (temporary files are dot-prefixed and never listed)."""
    return sorted(p for p in data_dir.glob("target_model=*/date=*/hour=*/*.parquet")
                  if not p.name.startswith("."))


@dataclass
class Row:
    """A decoded record chunk plus where it came from in Kafka."""

    record: Record
    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    ingested_at_s: float

    @property
    def nbytes(self) -> int:
        return len(self.record.aux_hidden) + len(self.record.final_hidden) + 5 * self.record.num_tokens


def _list_array(arrays: list[np.ndarray], value_type: pa.DataType, np_dtype: str) -> pa.Array:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([a.shape[0] for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays).astype(np_dtype, copy=False) if arrays else np.zeros(0, np_dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def _binary_column(values: list) -> pa.ChunkedArray:
    """One zero-copy chunk per value: Arrow points at the Kafka message bytes. Copying ~1 MB
    values into one Arrow buffer halved ingest throughput (page faults on fresh buffers)."""
    chunks = [pa.Array.from_buffers(pa.binary(), 1, [
        None, pa.py_buffer(np.array([0, len(v)], dtype=np.int32)), pa.py_buffer(v)])
        for v in values]
    return pa.chunked_array(chunks, pa.binary())


def rows_to_table(rows: list[Row]) -> pa.Table:
    """Columnar table of ``rows`` in PARQUET_SCHEMA order."""
    recs = [r.record for r in rows]
    columns = [
        pa.array([r.topic for r in rows], pa.string()),
        pa.array([r.partition for r in rows], pa.int32()),
        pa.array([r.offset for r in rows], pa.int64()),
        pa.array([r.timestamp_ms for r in rows], pa.int64()),
        pa.array([SCHEMA_VERSION] * len(rows), pa.int16()),
        pa.array([x.request_id for x in recs], pa.string()),
        pa.array([x.target_model_id for x in recs], pa.string()),
        pa.array([x.drafter_version for x in recs], pa.string()),
        _list_array([np.asarray(x.aux_layer_ids, dtype=np.int32) for x in recs], pa.int32(), "int32"),
        pa.array([x.workload for x in recs], pa.string()),
        pa.array([x.started_at_s for x in recs], pa.float64()),
        pa.array([x.finished_at_s for x in recs], pa.float64()),
        pa.array([r.ingested_at_s for r in rows], pa.float64()),
        pa.array([x.position_start for x in recs], pa.int32()),
        pa.array([x.num_tokens for x in recs], pa.int32()),
        pa.array([x.request_num_tokens or x.num_tokens for x in recs], pa.int32()),
        pa.array([x.chunk_index for x in recs], pa.int32()),
        pa.array([x.chunk_count for x in recs], pa.int32()),
        pa.array([x.hidden_size for x in recs], pa.int32()),
        pa.array([x.hidden_dtype for x in recs], pa.string()),
        _list_array([x.token_ids for x in recs], pa.int32(), "int32"),
        _list_array([x.loss_mask for x in recs], pa.uint8(), "uint8"),
        _binary_column([x.aux_hidden for x in recs]),
        _binary_column([x.final_hidden for x in recs]),
        pa.array([[{"position": p, "drafter_version": v} for p, v in x.version_changes] for x in recs],
                 PARQUET_SCHEMA.field("version_changes").type),
    ]
    return pa.Table.from_arrays(columns, schema=PARQUET_SCHEMA)


def row_to_record(row: dict) -> Record:
    """A Parquet row (as a dict of Python/numpy values) back to a Record."""
    return Record(
        request_id=row["request_id"], target_model_id=row["target_model_id"],
        drafter_version=row["drafter_version"], aux_layer_ids=tuple(row["aux_layer_ids"]),
        workload=row["workload"], started_at_s=row["started_at_s"],
        finished_at_s=row["finished_at_s"], hidden_size=row["hidden_size"],
        hidden_dtype=row["hidden_dtype"],
        token_ids=np.asarray(row["token_ids"], dtype=np.int32),
        loss_mask=np.asarray(row["loss_mask"], dtype=np.uint8),
        aux_hidden=row["aux_hidden"], final_hidden=row["final_hidden"],
        position_start=row["position_start"], request_num_tokens=row["request_num_tokens"],
        chunk_index=row["chunk_index"], chunk_count=row["chunk_count"],
        version_changes=version_changes_of(row))


def version_changes_of(row: dict) -> tuple[tuple[int, str], ...]:
    """A row's version changes; none in files written before the column existed."""
    return tuple((c["position"], c["drafter_version"]) for c in row.get("version_changes") or ())
