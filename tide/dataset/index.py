"""The dataset index: one SQLite file (``<data_dir>/index.sqlite``) with a row per Parquet file.

It lets the scheduler count new samples and the trainer pick a time window without opening any
Parquet file. Ingest adds a file right after its rename; ``reconcile`` (run at ingest start-up)
repairs the two crash windows: a renamed file not yet indexed is added from its footer and
columns, an indexed file that no longer exists is removed. WAL mode lets readers in other
processes (scheduler, trainer) read while ingest writes.

It also remembers what the dataset has deleted, so that nothing consumed again brings it back
(a replay after a failed commit, a chunk still in an open file): the request ids ``tide data
delete`` removed (kept for good: request ids are unique) and the retention cut, the newest
capture time retention has deleted up to (TTL: now - ttl; size budget: the newest file it
deleted). Ingest drops rows of deleted requests and rows captured at or before the cut when it
seals a file, holding the dataset lock (tide/dataset/lock.py) that deletion and retention take.
"""
from __future__ import annotations

import functools
import logging
import sqlite3
import threading
from dataclasses import asdict, fields
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tide.dataset.schema import FileName, list_files
from tide.dataset.writer import FileStats

log = logging.getLogger(__name__)

INDEX_NAME = "index.sqlite"
_COLUMNS = [f.name for f in fields(FileStats)]
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
  path TEXT PRIMARY KEY, target_model TEXT NOT NULL, topic TEXT NOT NULL,
  partition INTEGER NOT NULL, first_offset INTEGER NOT NULL, last_offset INTEGER NOT NULL,
  rows INTEGER NOT NULL, requests INTEGER NOT NULL, tokens INTEGER NOT NULL,
  generated_tokens INTEGER NOT NULL, min_time_s REAL NOT NULL, max_time_s REAL NOT NULL,
  bytes INTEGER NOT NULL, created_at_s REAL NOT NULL);
CREATE INDEX IF NOT EXISTS files_time ON files (max_time_s);
CREATE INDEX IF NOT EXISTS files_offsets ON files (topic, partition, last_offset);
CREATE TABLE IF NOT EXISTS file_requests (
  request_id TEXT NOT NULL, path TEXT NOT NULL, PRIMARY KEY (request_id, path)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS file_requests_path ON file_requests (path);
CREATE TABLE IF NOT EXISTS deleted_requests (
  request_id TEXT PRIMARY KEY, deleted_at_s REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value REAL NOT NULL) WITHOUT ROWID;
"""
_QUERY_CHUNK = 500  # ids per IN (...) query, below SQLite's parameter limit


def stats_from_file(data_dir: Path, path: Path) -> tuple[FileStats, set[str]]:
    """Index entry for an existing Parquet file (used when an entry was lost in a crash)."""
    name = FileName.parse(path.name)
    if name is None:
        raise ValueError(f"{path} is not named <topic>-p<partition>-<first>-<last>.parquet")
    table = pq.read_table(path, columns=["request_id", "target_model_id", "finished_at_s",
                                         "num_tokens", "loss_mask"])
    times = table.column("finished_at_s").to_numpy()
    mask_sum = pc.sum(pc.list_flatten(table.column("loss_mask"))).as_py() or 0
    stats = FileStats(
        path=str(path.relative_to(data_dir)),
        target_model=table.column("target_model_id")[0].as_py() if table.num_rows else "",
        topic=name.topic, partition=name.partition, first_offset=name.first_offset,
        last_offset=name.last_offset, rows=table.num_rows,
        requests=len(set(table.column("request_id").to_pylist())),
        tokens=int(np.sum(table.column("num_tokens").to_numpy())) if table.num_rows else 0,
        generated_tokens=int(mask_sum),
        min_time_s=float(times.min()) if times.size else 0.0,
        max_time_s=float(times.max()) if times.size else 0.0,
        bytes=path.stat().st_size, created_at_s=path.stat().st_mtime)
    return stats, set(table.column("request_id").to_pylist())


def _locked(method):
    """One sqlite3 connection is shared by ingest's threads: serialise its use."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class DatasetIndex:
    def __init__(self, data_dir: str | Path, read_only: bool = False) -> None:
        """``read_only``: for readers on a read-only mount (a retrain Job's view of the dataset):
        never creates, migrates or writes anything; raises sqlite3.Error where SQLite cannot read
        the index that way (a WAL index no writer holds open), and the caller lists files instead."""
        self._lock = threading.RLock()
        self.data_dir = Path(data_dir)
        if read_only:
            uri = (self.data_dir / INDEX_NAME).resolve().as_uri() + "?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, timeout=30.0, check_same_thread=False,
                                       isolation_level=None)
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.data_dir / INDEX_NAME, timeout=30.0,
                                   check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    @_locked
    def close(self) -> None:
        self._db.close()

    @_locked
    def add(self, stats: FileStats, request_ids: Iterable[str]) -> None:
        values = asdict(stats)
        with self._transaction():
            self._db.execute(
                f"INSERT OR REPLACE INTO files ({','.join(_COLUMNS)}) "
                f"VALUES ({','.join('?' * len(_COLUMNS))})", [values[c] for c in _COLUMNS])
            self._db.execute("DELETE FROM file_requests WHERE path = ?", (stats.path,))
            self._db.executemany("INSERT OR IGNORE INTO file_requests VALUES (?, ?)",
                                 [(rid, stats.path) for rid in request_ids])

    @_locked
    def remove(self, path: str) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM files WHERE path = ?", (path,))
            self._db.execute("DELETE FROM file_requests WHERE path = ?", (path,))

    def _transaction(self):
        db = self._db

        class _Tx:
            def __enter__(self):
                db.execute("BEGIN IMMEDIATE")

            def __exit__(self, exc_type, *_):
                db.execute("ROLLBACK" if exc_type else "COMMIT")

        return _Tx()

    @_locked
    def files(self, since_s: float | None = None, until_s: float | None = None,
              target_model: str | None = None, created_after_s: float | None = None
              ) -> list[FileStats]:
        """Files overlapping the capture-time window [since_s, until_s), oldest first."""
        where, args = self._where(since_s, until_s, target_model, created_after_s)
        rows = self._db.execute(
            f"SELECT {','.join(_COLUMNS)} FROM files {where} ORDER BY max_time_s, path", args)
        return [FileStats(*row) for row in rows]

    @_locked
    def summary(self, since_s: float | None = None, until_s: float | None = None,
                target_model: str | None = None, created_after_s: float | None = None) -> dict:
        """Totals for the scheduler: files, rows, requests, tokens, bytes, time range."""
        where, args = self._where(since_s, until_s, target_model, created_after_s)
        row = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(rows),0), COALESCE(SUM(requests),0), "
            "COALESCE(SUM(tokens),0), COALESCE(SUM(generated_tokens),0), COALESCE(SUM(bytes),0), "
            f"MIN(min_time_s), MAX(max_time_s) FROM files {where}", args).fetchone()
        keys = ("files", "rows", "requests", "tokens", "generated_tokens", "bytes",
                "min_time_s", "max_time_s")
        return dict(zip(keys, row))

    @staticmethod
    def _where(since_s, until_s, target_model, created_after_s) -> tuple[str, list]:
        clauses, args = [], []
        if since_s is not None:
            clauses.append("max_time_s >= ?")
            args.append(since_s)
        if until_s is not None:
            clauses.append("min_time_s < ?")
            args.append(until_s)
        if target_model is not None:
            clauses.append("target_model = ?")
            args.append(target_model)
        if created_after_s is not None:
            clauses.append("created_at_s > ?")
            args.append(created_after_s)
        return ("WHERE " + " AND ".join(clauses)) if clauses else "", args

    @_locked
    def get(self, path: str) -> FileStats | None:
        row = self._db.execute(f"SELECT {','.join(_COLUMNS)} FROM files WHERE path = ?",
                               (path,)).fetchone()
        return FileStats(*row) if row else None

    @_locked
    def files_for_request(self, request_id: str) -> list[str]:
        rows = self._db.execute("SELECT path FROM file_requests WHERE request_id = ?",
                                (request_id,))
        return [r[0] for r in rows]

    @_locked
    def files_after(self, topic: str, partition: int, offset: int) -> list[FileStats]:
        """Files of one topic partition holding any offset >= ``offset``."""
        rows = self._db.execute(
            f"SELECT {','.join(_COLUMNS)} FROM files WHERE topic = ? AND partition = ? "
            "AND last_offset >= ?", (topic, partition, offset))
        return [FileStats(*row) for row in rows]

    @_locked
    def reconcile(self) -> tuple[int, int]:
        """Make the index match the files on disk; returns (added, removed)."""
        on_disk = {str(p.relative_to(self.data_dir)): p for p in list_files(self.data_dir)}
        indexed = {r[0] for r in self._db.execute("SELECT path FROM files")}
        added = removed = 0
        for rel in sorted(indexed - set(on_disk)):
            self.remove(rel)
            removed += 1
        for rel in sorted(set(on_disk) - indexed):
            try:
                stats, request_ids = stats_from_file(self.data_dir, on_disk[rel])
            except (ValueError, OSError) as exc:  # a foreign or unreadable file: leave it alone
                log.warning("index: skipping %s: %s", rel, exc)
                continue
            self.add(stats, request_ids)
            added += 1
        return added, removed

    @_locked
    def mark_deleted(self, request_ids: Iterable[str], at_s: float) -> None:
        with self._transaction():
            self._db.executemany("INSERT OR IGNORE INTO deleted_requests VALUES (?, ?)",
                                 [(rid, at_s) for rid in request_ids])

    @_locked
    def deleted_among(self, request_ids: Iterable[str]) -> set[str]:
        """Those of ``request_ids`` that ``tide data delete`` has removed."""
        ids, found = list(request_ids), set()
        for i in range(0, len(ids), _QUERY_CHUNK):
            chunk = ids[i:i + _QUERY_CHUNK]
            rows = self._db.execute("SELECT request_id FROM deleted_requests WHERE request_id IN "
                                    f"({','.join('?' * len(chunk))})", chunk)
            found.update(r[0] for r in rows)
        return found

    @_locked
    def retention_cut_s(self) -> float:
        """Rows captured at or before this are deleted (-inf: retention deleted nothing yet)."""
        row = self._db.execute("SELECT value FROM settings WHERE key = 'retention_cut_s'").fetchone()
        return float(row[0]) if row else float("-inf")

    @_locked
    def raise_retention_cut(self, cut_s: float) -> None:
        with self._transaction():
            self._db.execute("INSERT INTO settings VALUES ('retention_cut_s', ?) ON CONFLICT(key) "
                             "DO UPDATE SET value = max(value, excluded.value)", (cut_s,))

    @_locked
    def totals(self) -> tuple[int, int]:
        """(files, bytes) of the whole dataset."""
        row = self._db.execute("SELECT COUNT(*), COALESCE(SUM(bytes),0) FROM files").fetchone()
        return int(row[0]), int(row[1])
