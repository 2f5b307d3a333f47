"""The dataset's table schema: one row per record chunk, partitioned by capture date and hour.

Written down for other tools in ``schemas/parquet.schema.json`` (packaged as ``tide.schemas``; a
test keeps the two equal). The dataset is one Delta Lake table (tide/dataset/table.py): its
columns are ``PARQUET_SCHEMA`` plus the partition columns ``date`` (UTC date of ``finished_at_s``)
and ``hour`` (its UTC hour), which live in the table log's partition values, not in the data
files (Delta's convention), so retention and windows prune whole ``date=/hour=`` folders.
Chunks are stored as they came (not reassembled): a batch never waits for a request's other
chunks, and the reader joins them. Delta has no unsigned integers: the loss mask is int8.
"""
from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

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
    ("loss_mask", pa.list_(pa.int8())),
    ("aux_hidden", pa.binary()),
    ("final_hidden", pa.binary()),
    ("version_changes", pa.list_(pa.struct([("position", pa.int32()), ("drafter_version", pa.string())]))),
])
PARTITION_COLUMNS = ("date", "hour")
TABLE_SCHEMA = PARQUET_SCHEMA.append(pa.field("date", pa.date32())).append(pa.field("hour", pa.int32()))
HIDDEN_COLUMNS = ("aux_hidden", "final_hidden")
# bf16/fp8 activations barely compress; zstd on them costs ingest CPU for ~10 % of bytes
COLUMN_COMPRESSION = {name: ("none" if name in HIDDEN_COLUMNS else "zstd")
                      for name in PARQUET_SCHEMA.names}
STATISTICS_COLUMNS = [n for n in PARQUET_SCHEMA.names if n not in HIDDEN_COLUMNS
                      and n not in ("token_ids", "loss_mask", "aux_layer_ids", "version_changes")]
# min/max written into each file's add action: what windows, retention and replays prune on
_STATS_COLUMNS = ("kafka_partition", "kafka_offset", "request_id", "target_model_id", "finished_at_s",
                  "ingested_at_s", "chunk_index")


def partition_values(at_s: float) -> dict[str, str]:
    """Delta partition values (strings, as the log stores them) for a capture time (UTC)."""
    t = time.gmtime(at_s)
    return {"date": f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}", "hour": str(t.tm_hour)}


def partition_path(values: dict[str, str]) -> str:
    """The folder of a partition inside the table, hive style: ``date=YYYY-MM-DD/hour=H``."""
    return "/".join(f"{k}={values[k]}" for k in PARTITION_COLUMNS)


def partition_start_s(values: dict) -> float:
    """The first second of a partition (UTC), from log values (strings) or typed ones."""
    day = values["date"]
    if isinstance(day, str):
        day = datetime.date.fromisoformat(day)
    start = datetime.datetime(day.year, day.month, day.day, int(values["hour"]), tzinfo=datetime.timezone.utc)
    return start.timestamp()


def file_stats(table: pa.Table) -> str:
    """Delta add-action statistics (JSON) of a data file holding ``table``."""
    mins, maxs, nulls = {}, {}, {}
    for name in _STATS_COLUMNS:
        column = table.column(name)
        nulls[name] = column.null_count
        if table.num_rows > column.null_count:
            bounds = pc.min_max(column)
            mins[name], maxs[name] = bounds["min"].as_py(), bounds["max"].as_py()
    return json.dumps({"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs,
                       "nullCount": nulls})


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
        _list_array([x.loss_mask for x in recs], pa.int8(), "int8"),
        _binary_column([x.aux_hidden for x in recs]),
        _binary_column([x.final_hidden for x in recs]),
        pa.array([[{"position": p, "drafter_version": v} for p, v in x.version_changes] for x in recs],
                 PARQUET_SCHEMA.field("version_changes").type),
    ]
    return pa.Table.from_arrays(columns, schema=PARQUET_SCHEMA)


def row_to_record(row: dict) -> Record:
    """A table row (as a dict of Python/numpy values) back to a Record."""
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
    """A row's version changes (empty when there were none)."""
    return tuple((c["position"], c["drafter_version"]) for c in row.get("version_changes") or ())
