"""The dataset's write lock: ``<data_dir>/dataset.lock``, a ``flock`` that ingest's seals share
and that deletion and retention take alone.

Why: a seal publishes a file and indexes it; ``delete_request`` rewrites files and records the
request as deleted; retention unlinks files and raises the retention cut. Each of these reads
what the others write (the index, the deleted requests, the cut), so a deletion that ran in the
middle of another deletion, a retention pass or a seal could be undone by it. Holding the lock,
each sees the others' results whole. Ingest replicas (one per consumer group member) share it;
readers (the trainer, ``tide data stats``) never take it.

``flock`` locks belong to an open file description: two threads of one process that each call
``dataset_lock`` exclude each other like two processes do; the lock goes when its holder dies.
"""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOCK_NAME = "dataset.lock"


class LockBusy(Exception):
    """``blocking=False`` and another holder has the lock."""


@contextmanager
def dataset_lock(data_dir: str | Path, exclusive: bool, blocking: bool = True) -> Iterator[None]:
    fd = os.open(Path(data_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode if blocking else mode | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise LockBusy(f"{Path(data_dir) / LOCK_NAME} is held by another process") from exc
        yield
    finally:
        os.close(fd)  # releases the lock
