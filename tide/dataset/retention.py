"""Retention of the dataset: by age, by size budget, and per request on demand.

``apply_retention`` steps:
1. delete files whose newest capture is older than ``ttl_s``;
2. while the dataset is over ``max_bytes``, delete the file with the oldest newest-capture;
   deletion unlinks first, then drops the index entry (a crash in between leaves a stale entry
   that ``DatasetIndex.reconcile`` removes).
``delete_request`` rewrites every file holding the request without its rows (temporary file,
fsync, atomic rename over the original), or deletes a file left empty.

Data still in the Kafka topic is governed by the topic's own retention, not by this module.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from tide import metrics
from tide.dataset.index import DatasetIndex, stats_from_file
from tide.dataset.schema import COLUMN_COMPRESSION, STATISTICS_COLUMNS
from tide.dataset.writer import fsync_dir

log = logging.getLogger(__name__)


def _delete(data_dir: Path, index: DatasetIndex, rel: str, reason: str) -> None:
    path = data_dir / rel
    path.unlink(missing_ok=True)
    fsync_dir(path.parent)
    index.remove(rel)
    metrics.INGEST_RETENTION_DELETED.labels(reason).inc()


def apply_retention(data_dir: Path, index: DatasetIndex, ttl_s: float, max_bytes: int,
                    now_s: float | None = None) -> list[str]:
    """Delete expired files, then the oldest files beyond the size budget; returns their paths."""
    now_s = time.time() if now_s is None else now_s
    deleted: list[str] = []
    files = index.files()  # oldest newest-capture first
    kept = []
    for stats in files:
        if stats.max_time_s < now_s - ttl_s:
            _delete(data_dir, index, stats.path, "ttl")
            deleted.append(stats.path)
        else:
            kept.append(stats)
    total = sum(s.bytes for s in kept)
    for stats in kept:
        if total <= max_bytes:
            break
        _delete(data_dir, index, stats.path, "size")
        deleted.append(stats.path)
        total -= stats.bytes
    return deleted


def delete_request(data_dir: str | Path, request_id: str, index: DatasetIndex | None = None
                   ) -> int:
    """Remove every row of ``request_id`` from the dataset; returns rows removed."""
    data_dir = Path(data_dir)
    own_index = index is None
    index = index or DatasetIndex(data_dir)
    removed = 0
    try:
        for rel in index.files_for_request(request_id):
            path = data_dir / rel
            if not path.exists():
                index.remove(rel)
                continue
            table = pq.read_table(path)
            keep = pc.not_equal(table.column("request_id"), request_id)
            kept = table.filter(keep)
            removed += table.num_rows - kept.num_rows
            if kept.num_rows == 0:
                _delete(data_dir, index, rel, "request")
                continue
            tmp = path.parent / f".{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as handle:
                pq.write_table(kept, handle, compression=COLUMN_COMPRESSION,
                               write_statistics=STATISTICS_COLUMNS, use_dictionary=False,
                               row_group_size=max(1, min(64, kept.num_rows)))
                handle.flush()
                os.fsync(handle.fileno())
            os.rename(tmp, path)
            fsync_dir(path.parent)
            previous = index.get(rel)
            stats, request_ids = stats_from_file(data_dir, path)
            if previous is not None:  # the scheduler counts files by creation: keep it
                stats.created_at_s = previous.created_at_s
            index.add(stats, request_ids)
            metrics.INGEST_RETENTION_DELETED.labels("request").inc()
    finally:
        if own_index:
            index.close()
    log.info("dataset: removed %d rows of request %s", removed, request_id)
    return removed
