"""A single background thread that does ingest's disk work, so consuming overlaps writing.

The consumer thread decodes messages and hands rows here; this thread builds Arrow columns,
writes row groups (pyarrow releases the GIL), seals files (fsync, rename, fsync dir) and adds
them to the index. Tasks run in submission order, so a partition's seal always comes after its
rows. Steps of a seal task: seal each file -> index each file -> resolve the returned future with
the files' stats (or the exception). The queue is bounded (``max_pending_rows``): a slow disk
slows the consumer instead of growing memory.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from tide.dataset.index import DatasetIndex
from tide.dataset.schema import Row
from tide.dataset.writer import FileStats, OpenFile

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
            try:
                sealed = []
                for open_file in files:
                    error = self._failed.pop(id(open_file), None)
                    if error is not None:
                        open_file.discard()
                        raise _Poisoned(f"writing a row failed: {error}") from error
                    stats = open_file.seal(created_at_s)
                    self.index.add(stats, open_file.request_ids)
                    sealed.append(stats)
            except BaseException as exc:
                for open_file in files:
                    self._failed.pop(id(open_file), None)
                future.set_exception(exc)
            else:
                future.set_result(sealed)

        self._tasks.put(task)
        return future

    def discard(self, files: list[OpenFile]) -> None:
        def task() -> None:
            for open_file in files:
                self._failed.pop(id(open_file), None)
                try:
                    open_file.discard()
                except OSError:
                    log.exception("discarding a temporary file failed")

        self._tasks.put(task)

    def wait_idle(self) -> None:
        """Block until every submitted task has run."""
        self._tasks.join()

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join(timeout=60)
