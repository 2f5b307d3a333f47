"""Deletion, retention and compaction: table operations on the dataset's Delta table.

``delete_requests``: tombstone the ids first (tide/dataset/tombstones.py), then ``DELETE WHERE
request_id IN (...)``. Delta checks the DELETE against concurrent commits: an append that landed
after it read the table makes it fail, and it is run again on the newer version (so it also
removes rows appended meanwhile); an append it beat fails instead and ingest commits again after
re-reading the tombstones. The files the DELETE rewrote stay readable by older versions until
VACUUM removes them (``ingest.vacuum_retention_hours``); retrain windows skip tombstoned ids, so
nothing trains on them meanwhile.

``apply_retention`` (TTL, then size budget): the cut = ``now - ttl_s``, raised to the newest
capture of the oldest files while the table is over ``max_bytes``; ``DELETE WHERE finished_at_s <=
cut``, then VACUUM: files no version within the vacuum retention references are removed from
storage, so a retrain reading an older version later finds them gone (and skips them).

``compact``: small files of partitions whose hour has ended are rewritten into few large ones
(delta-rs OPTIMIZE). Compaction only rewrites live files: one whose rows a concurrent DELETE
removed makes the compaction's commit fail (tried again next pass), so compaction never brings
deleted rows back. The scheduler service runs retention and compaction every
``ingest.retention_interval_s`` (one replica, its own tick: ingest replicas never do).
"""
from __future__ import annotations

import logging
import time
from typing import Iterable

from tide import metrics
from tide.dataset.table import DatasetTable
from tide.dataset.tombstones import Tombstones

log = logging.getLogger(__name__)

_IDS_PER_DELETE = 500
_ATTEMPTS = 20


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _retried(what: str, operation):
    """Run a table operation, again on the newer version when a concurrent commit made it fail."""
    from deltalake.exceptions import CommitFailedError

    for attempt in range(_ATTEMPTS):
        try:
            return operation()
        except CommitFailedError as exc:
            log.info("dataset: %s conflicted with a concurrent commit (%s); again", what, exc)
            time.sleep(min(1.0, 0.02 * 2 ** attempt))
    raise RuntimeError(f"dataset: {what} kept conflicting with concurrent commits")


def _delete(table: DatasetTable, predicate: str, what: str) -> int:
    if not table.exists():
        return 0
    result = _retried(what, lambda: table.delta().delete(predicate))
    return int(result.get("num_deleted_rows", 0))


def delete_requests(table: DatasetTable, request_ids: Iterable[str], tombstones: Tombstones | None = None
                    ) -> dict[str, int]:
    """Remove every row of ``request_ids``, now and from later ingest; rows removed per id."""
    ids = sorted(set(request_ids))
    tombstones = tombstones or Tombstones(table.location)
    tombstones.add(ids)  # before the DELETE: ingest commits after it see the tombstones
    found = _rows_of(table, ids)
    for i in range(0, len(ids), _IDS_PER_DELETE):
        chunk = ids[i:i + _IDS_PER_DELETE]
        removed = _delete(table, f"request_id IN ({', '.join(_quote(r) for r in chunk)})", "delete")
        if removed:
            metrics.INGEST_RETENTION_DELETED.labels("request").inc(removed)
    log.info("dataset: deleted %d requests (%d rows)", len(ids), sum(found.values()))
    return {rid: found.get(rid, 0) for rid in ids}


def _rows_of(table: DatasetTable, ids: list[str]) -> dict[str, int]:
    """Rows per id in the newest version (read from the request_id column of files whose
    statistics may hold them)."""
    if not table.exists() or not ids:
        return {}
    lo, hi, wanted, out = min(ids), max(ids), set(ids), {}
    for f in _files_with_ids(table, lo, hi):
        try:
            column = table.open_file(f).read(columns=["request_id"]).column(0).to_pylist()
        except FileNotFoundError:
            continue
        for rid in column:
            if rid in wanted:
                out[rid] = out.get(rid, 0) + 1
    return out


def _files_with_ids(table: DatasetTable, lo: str, hi: str) -> list[str]:
    import pyarrow as pa

    actions = pa.table(table.delta().get_add_actions(flatten=True)).to_pylist()
    out = []
    for a in actions:
        a_lo, a_hi = a.get("min.request_id"), a.get("max.request_id")
        if a_lo is None or a_hi is None or not (a_hi < lo or a_lo > hi):
            out.append(a["path"])
    return out


def apply_retention(table: DatasetTable, ttl_s: float, max_bytes: int, now_s: float | None = None,
                    vacuum_retention_hours: int = 0) -> list[str]:
    """DELETE rows past the TTL and, oldest first, beyond the size budget, then VACUUM; returns
    the data files the DELETE took out of the table."""
    if not table.exists():
        return []
    now_s = time.time() if now_s is None else now_s
    files = table.data_files()
    cut_s = now_s - ttl_s
    total = sum(f.size for f in files if f.max_time_s > cut_s)
    for f in files:  # oldest newest-capture first
        if total <= max_bytes:
            break
        if f.max_time_s > cut_s:
            cut_s, total = f.max_time_s, total - f.size
    before = {f.path for f in files}
    if any(f.min_time_s <= cut_s for f in files):
        rows = _delete(table, f"finished_at_s <= {cut_s!r}", "retention")
        log.info("dataset: retention deleted %d rows captured at or before %.3f", rows, cut_s)
    gone = sorted(before - {f.path for f in table.data_files()})
    for _ in gone:
        metrics.INGEST_RETENTION_DELETED.labels("ttl").inc()
    vacuum(table, vacuum_retention_hours)
    return gone


def vacuum(table: DatasetTable, retention_hours: int) -> list[str]:
    """Remove files no version within ``retention_hours`` references (deleted, compacted away,
    or never committed)."""
    if not table.exists():
        return []
    # full: also files no commit ever named (a writer that died before its commit, a lost race)
    removed = table.delta().vacuum(retention_hours=max(0, int(retention_hours)), dry_run=False,
                                   enforce_retention_duration=False, full=True)
    if removed:
        log.info("dataset: vacuum removed %d files", len(removed))
    return removed


def compact(table: DatasetTable, target_bytes: int, settled_before_s: float) -> int:
    """Rewrite the small files of every partition whose hour ended before ``settled_before_s``
    with more than one small file; returns files removed (conflicts are left for next time)."""
    from deltalake.exceptions import CommitFailedError

    from tide.dataset.schema import partition_start_s

    if not table.exists():
        return 0
    import pyarrow as pa

    actions = pa.table(table.delta().get_add_actions(flatten=True)).to_pylist()
    small: dict[tuple, int] = {}
    for a in actions:
        key = (a["partition.date"], a["partition.hour"])
        if a["size_bytes"] < target_bytes and partition_start_s({"date": key[0], "hour": key[1]}) + 3600 <= settled_before_s:
            small[key] = small.get(key, 0) + 1
    removed = 0
    for (day, hour), n in sorted(small.items()):
        if n < 2:
            continue
        try:
            result = table.delta().optimize.compact(
                partition_filters=[("date", "=", day.isoformat() if hasattr(day, "isoformat") else str(day)),
                                   ("hour", "=", str(hour))], target_size=target_bytes)
        except CommitFailedError as exc:  # a concurrent DELETE: its files are gone, try next pass
            log.info("dataset: compaction of date=%s/hour=%s conflicted (%s); next pass", day, hour, exc)
            continue
        removed += int(result.get("numFilesRemoved", 0))
    if removed:
        log.info("dataset: compaction replaced %d small files", removed)
    return removed


def maintain(table: DatasetTable, ingest_cfg, now_s: float | None = None) -> dict:
    """One maintenance pass (the scheduler's): retention (DELETE + VACUUM), then compaction."""
    now_s = time.time() if now_s is None else now_s
    # at least an hour: files ingest is writing are not in the log yet, and VACUUM must not take them
    gone = apply_retention(table, ingest_cfg.retention_ttl_s, ingest_cfg.retention_max_bytes, now_s,
                           max(1, ingest_cfg.vacuum_retention_hours))
    compacted = compact(table, ingest_cfg.compact_target_bytes, now_s - ingest_cfg.roll_interval_s)
    return {"files_deleted": len(gone), "files_compacted": compacted}
