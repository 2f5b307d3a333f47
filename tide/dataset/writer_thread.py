"""A single background thread that does ingest's disk work, so consuming overlaps writing.

The consumer thread decodes messages and hands rows here; this thread builds Arrow columns,
writes row groups (pyarrow releases the GIL), seals files (fsync, rename, fsync dir) and adds
them to the index. Tasks run in submission order, so a partition's seal always comes after its
rows. Steps of a seal task, per file: finish it (footer, fsync) -> take the dataset lock
(shared; tide/dataset/lock.py) -> drop the rows of requests ``tide data delete`` removed and
rows at or before the retention cut (a rewrite, only when there are any: a replay or a chunk
that was in an open file during a deletion must not bring them back) -> rename, index -> release.
Then resolve the returned future with the files' stats, or the exception; a failure discards
that file and every later one of the seal (temporaries hold user data). The queue is bounded
(``max_pending_rows``): a slow disk slows the consumer instead of growing memory.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable

import pyarrow.parquet as pq

from tide import metrics
from tide.dataset.index import DatasetIndex, stats_from_file
from tide.dataset.lock import dataset_lock
from tide.dataset.schema import Row
from tide.dataset.writer import FileStats, OpenFile, without_rows, write_temporary

log = logging.getLogger(__name__)


class _Poisoned(Exception):
    """A row could not be written to this file earlier; sealing it must fail too."""


class WriterThread:
    def __init__(self, index: DatasetIndex, max_pending_rows: int = 64) -> None:
        self.index = index
        self._tasks: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_pending_rows)
        self._failed: dict[int, BaseException] = {}  # id(open file) -> first error
        self._thread = threading.Thread(target=self._run, name="tide-ingest-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            try:
                if task is None:
                    return
                task()
            except Exception:  # tasks report their own errors; this keeps the thread alive
                log.exception("ingest writer task failed")
            finally:
                self._tasks.task_done()

    def add(self, open_file: OpenFile, row: Row) -> None:
        def task() -> None:
            if id(open_file) in self._failed:
                return
            try:
                open_file.add(row)
            except Exception as exc:  # disk full, ...: reported when the file is sealed
                self._failed[id(open_file)] = exc

        self._tasks.put(task)

    def seal(self, files: list[OpenFile], created_at_s: float) -> "Future[list[FileStats]]":
        future: Future[list[FileStats]] = Future()

        def task() -> None:
            sealed: list[FileStats] = []
            error: BaseException | None = None
            for open_file in files:
                if error is None:
                    try:
                        sealed.extend(self._seal_one(open_file, created_at_s))
                        continue
                    except BaseException as exc:
                        error = exc
                self._discard(open_file)
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(sealed)

        self._tasks.put(task)
        return future

    def _seal_one(self, open_file: OpenFile, created_at_s: float) -> list[FileStats]:
        error = self._failed.pop(id(open_file), None)
        if error is not None:
            raise _Poisoned(f"writing a row failed: {error}") from error
        open_file.finish()
        with dataset_lock(self.index.data_dir, exclusive=False):
            deleted = self.index.deleted_among(open_file.request_ids)
            cut_s = self.index.retention_cut_s()
            if deleted or open_file.min_time_s <= cut_s:
                return self._publish_without(open_file, deleted, cut_s, created_at_s)
            stats = open_file.stats(open_file.publish(), created_at_s)
            self.index.add(stats, open_file.request_ids)
            return [stats]

    def _publish_without(self, open_file: OpenFile, deleted: set[str], cut_s: float,
                         created_at_s: float) -> list[FileStats]:
        """The rare path: the file holds rows the dataset deleted meanwhile; publish the rest."""
        with pq.ParquetFile(open_file.temporary) as parquet:  # closed before it is unlinked
            table = parquet.read()
        kept = without_rows(table, deleted, cut_s)
        of_deleted = table.num_rows - without_rows(table, deleted, float("-inf")).num_rows
        metrics.INGEST_DROPPED_ROWS.labels("request_deleted").inc(of_deleted)
        metrics.INGEST_DROPPED_ROWS.labels("expired").inc(table.num_rows - kept.num_rows - of_deleted)
        if kept.num_rows == 0:
            open_file.discard()
            return []
        final = open_file.publish(write_temporary(kept, open_file.temporary.parent))
        stats, request_ids = stats_from_file(self.index.data_dir, final)
        stats.created_at_s = created_at_s
        self.index.add(stats, request_ids)
        return [stats]

    def discard(self, files: list[OpenFile]) -> None:
        def task() -> None:
            for open_file in files:
                self._discard(open_file)

        self._tasks.put(task)

    def _discard(self, open_file: OpenFile) -> None:
        self._failed.pop(id(open_file), None)
        try:
            open_file.discard()
        except OSError:  # must not keep a seal's future from being resolved
            log.exception("discarding a temporary file failed")

    def wait_idle(self) -> None:
        """Block until every submitted task has run."""
        self._tasks.join()

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join(timeout=60)
