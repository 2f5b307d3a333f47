"""Retention of the dataset: by age, by size budget, and per request on demand.

Both run holding the dataset lock alone (tide/dataset/lock.py), so neither interleaves with the
other, with another deletion, or with an ingest seal, and both record what they deleted in the
index before deleting it, so that ingest drops those rows if it consumes them again (a replay
after a failed commit; chunks that were in an open file during the deletion).

``apply_retention`` steps:
1. plan: files whose newest capture is older than ``ttl_s``, then, while the dataset is over
   ``max_bytes``, the file with the oldest newest-capture;
2. raise the retention cut to ``now - ttl_s`` and to the newest capture of the planned files
   (on a full disk that refuses the index's write, after unlinking them: retention is how space
   comes back);
3. delete: unlink first, then drop the index entry (a crash in between leaves a stale entry that
   ``DatasetIndex.reconcile`` removes).
``delete_request`` steps: record the request as deleted -> reconcile the index (a file renamed
by a seal that crashed before indexing it must not be missed) -> rewrite every file holding the
request without its rows (temporary file, fsync, atomic rename over the original; the temporary
is removed on error), or delete a file left empty.

Data still in the Kafka topic is governed by the topic's own retention, not by this module.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

import pyarrow.parquet as pq

from tide import metrics
from tide.dataset.index import DatasetIndex, stats_from_file
from tide.dataset.lock import dataset_lock
from tide.dataset.writer import fsync_dir, without_rows, write_temporary

log = logging.getLogger(__name__)


def _delete(data_dir: Path, index: DatasetIndex, rel: str, reason: str) -> None:
    path = data_dir / rel
    path.unlink(missing_ok=True)
    fsync_dir(path.parent)
    index.remove(rel)
    metrics.INGEST_RETENTION_DELETED.labels(reason).inc()


def apply_retention(data_dir: Path, index: DatasetIndex, ttl_s: float, max_bytes: int,
                    now_s: float | None = None, blocking: bool = True) -> list[str]:
    """Delete expired files, then the oldest files beyond the size budget; returns their paths.
    ``blocking=False``: raise LockBusy instead of waiting for the dataset lock."""
    now_s = time.time() if now_s is None else now_s
    with dataset_lock(data_dir, exclusive=True, blocking=blocking):
        plan: list[tuple[str, str, float]] = []  # (path, reason, newest capture)
        kept = []
        for stats in index.files():  # oldest newest-capture first
            if stats.max_time_s < now_s - ttl_s:
                plan.append((stats.path, "ttl", stats.max_time_s))
            else:
                kept.append(stats)
        total = sum(s.bytes for s in kept)
        for stats in kept:
            if total <= max_bytes:
                break
            plan.append((stats.path, "size", stats.max_time_s))
            total -= stats.bytes
        cut_s = max([now_s - ttl_s] + [t for _, _, t in plan])
        try:
            index.raise_retention_cut(cut_s)
        except sqlite3.Error:  # a full disk refuses the index's write: make room first
            for rel, _, _ in plan:
                (data_dir / rel).unlink(missing_ok=True)
            index.raise_retention_cut(cut_s)
        for rel, reason, _ in plan:
            _delete(data_dir, index, rel, reason)
    return [rel for rel, _, _ in plan]


def delete_request(data_dir: str | Path, request_id: str, index: DatasetIndex | None = None
                   ) -> int:
    """Remove every row of ``request_id`` from the dataset, now and from later ingest; returns
    rows removed."""
    data_dir = Path(data_dir)
    own_index = index is None
    index = index or DatasetIndex(data_dir)
    removed = 0
    try:
        with dataset_lock(data_dir, exclusive=True):
            index.mark_deleted([request_id], time.time())
            index.reconcile()
            for rel in index.files_for_request(request_id):
                removed += _rewrite_without(data_dir, index, rel, request_id)
    finally:
        if own_index:
            index.close()
    log.info("dataset: removed %d rows of request %s", removed, request_id)
    return removed


def _rewrite_without(data_dir: Path, index: DatasetIndex, rel: str, request_id: str) -> int:
    """Rewrite one file without the request's rows; returns how many it held."""
    path = data_dir / rel
    if not path.exists():
        index.remove(rel)
        return 0
    table = pq.read_table(path)
    kept = without_rows(table, {request_id}, float("-inf"))
    if kept.num_rows == 0:
        _delete(data_dir, index, rel, "request")
        return table.num_rows
    tmp = write_temporary(kept, path.parent)
    try:
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    previous = index.get(rel)
    stats, request_ids = stats_from_file(data_dir, path)
    if previous is not None:  # the scheduler counts files by creation: keep it
        stats.created_at_s = previous.created_at_s
    index.add(stats, request_ids)
    metrics.INGEST_RETENTION_DELETED.labels("request").inc()
    return table.num_rows - kept.num_rows
