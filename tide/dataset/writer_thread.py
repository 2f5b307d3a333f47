"""A single background thread that does ingest's storage work, so consuming overlaps writing.

The consumer thread decodes messages and hands rows here; this thread builds Arrow columns and
streams row groups into data files (pyarrow releases the GIL). A seal task, per batch of one
topic partition: finish its files -> wait for the batch's dead letters to be acknowledged (before
anything records the offsets as done) -> drop rows of tombstoned requests and rows past the
retention TTL (a rewrite, only when there are any) -> commit the files to the table with the
partition's application transaction -> check the tombstones again and DELETE any request
tombstoned while the commit was in flight. The returned future resolves to a ``Sealed`` or the
exception; a failure deletes the batch's files (they hold user data; the offsets are consumed
again). Tasks run in submission order; the queue is bounded (``max_pending_rows``): a slow
store slows the consumer instead of growing memory.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from tide import metrics
from tide.dataset.retention import delete_requests
from tide.dataset.schema import Row
from tide.dataset.table import DatasetTable, Stale
from tide.dataset.tombstones import Tombstones
from tide.dataset.writer import DataFileWriter, FileOut, add_counts_all, rewrite_without

log = logging.getLogger(__name__)


class _Poisoned(Exception):
    """A row could not be written to this file earlier; sealing it must fail too."""


@dataclass
class Sealed:
    """A batch's outcome: committed (``version``; None when no row was left to commit), or
    ``stale_at``: the table already held its offsets up to there (another replica wrote them)."""

    version: int | None = None
    files: list[FileOut] = field(default_factory=list)
    stale_at: int | None = None


@dataclass
class Batch:
    files: list[DataFileWriter]
    app_ids: tuple  # PartitionState.app_ids: the checked transaction first, then those recorded alongside
    first_offset: int
    last_offset: int
    dead_letters: list
    recorded_before: int  # the app's offset the table must hold first (PartitionState.recorded_before)


class WriterThread:
    def __init__(self, table: DatasetTable, tombstones: Tombstones, confirm: Callable[[list], None],
                 max_pending_rows: int = 64) -> None:
        self.table = table
        self.tombstones = tombstones
        self.confirm = confirm  # waits for dead letters (DeadLetters.confirm)
        self._tasks: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_pending_rows)
        self._failed: dict[int, BaseException] = {}  # id(file) -> first error
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

    def add(self, data_file: DataFileWriter, row: Row) -> None:
        def task() -> None:
            if id(data_file) in self._failed:
                return
            try:
                data_file.add(row)
            except Exception as exc:  # store full or unreachable, ...: reported at seal time
                self._failed[id(data_file)] = exc

        self._tasks.put(task)

    def seal(self, batch: Batch) -> "Future[Sealed]":
        future: Future[Sealed] = Future()

        def task() -> None:
            outs: list[FileOut] = []
            try:
                for data_file in batch.files:
                    error = self._failed.pop(id(data_file), None)
                    if error is not None:
                        raise _Poisoned(f"writing a row failed: {error}") from error
                    outs.append(data_file.finish())
                self.confirm(batch.dead_letters)
                future.set_result(self._commit(batch, outs))
            except BaseException as exc:
                for data_file in batch.files:
                    self._discard(data_file)
                future.set_exception(exc)

        self._tasks.put(task)
        return future

    def _commit(self, batch: Batch, outs: list[FileOut]) -> Sealed:
        ids = set().union(*(o.request_ids for o in outs)) if outs else set()
        deleted = self.tombstones.among(ids)
        kept: list[FileOut] = []
        for out in outs:
            if not deleted & out.request_ids:
                kept.append(out)
                continue
            copy, of_deleted = rewrite_without(self.table.location, out, deleted)
            metrics.INGEST_DROPPED_ROWS.labels("request_deleted").inc(of_deleted)
            if copy is not None:
                kept.append(copy)
        if not kept:
            return Sealed()
        counts: dict = {}
        for out in kept:
            add_counts_all(counts, out.counts)
        try:
            (checked, _), *alongside = batch.app_ids
            version = self.table.append([o.add for o in kept], counts, checked, batch.recorded_before,
                                        batch.last_offset, also={a: batch.last_offset if v is None else v
                                                                 for a, v in alongside})
        except Stale as stale:
            for data_file in batch.files:
                self._discard(data_file)
            return Sealed(stale_at=stale.version)
        late = self.tombstones.among(set().union(*(o.request_ids for o in kept)))
        if late:  # tombstoned while this commit was in flight: its deleter may not have seen it
            log.info("ingest: %d requests deleted during a commit; deleting them again", len(late))
            delete_requests(self.table, sorted(late), self.tombstones)
        return Sealed(version, kept)

    def discard(self, files: list[DataFileWriter]) -> None:
        def task() -> None:
            for data_file in files:
                self._discard(data_file)

        self._tasks.put(task)

    def _discard(self, data_file: DataFileWriter) -> None:
        self._failed.pop(id(data_file), None)
        try:
            data_file.discard()
        except OSError:  # must not keep a seal's future from being resolved
            log.exception("discarding a data file failed")

    def wait_idle(self) -> None:
        """Block until every submitted task has run."""
        self._tasks.join()

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join(timeout=60)
