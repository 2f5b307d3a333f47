"""What ingest holds per topic partition between consuming a message and committing its offset.

``PartitionState``: the open files of the current batch, its offset range and its dead letters.
``Seal``: a batch handed to the writer thread, committed once the writer has sealed it.
``stored_after``: the offsets of a partition already durable on disk past a resume point, each
with the request id and chunk index stored there (replay detection: a replayed message is
skipped; a different message at a stored offset means the topic was recreated).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tide.dataset.index import DatasetIndex
from tide.dataset.writer import OpenFile

log = logging.getLogger(__name__)


@dataclass
class PartitionState:
    """Consumed work of one topic partition not yet handed to a seal."""

    # offset -> (request id, chunk index) of rows already durable in files
    covered: dict[int, tuple[str, int]]
    files: dict[str, OpenFile] = field(default_factory=dict)
    first_offset: int = -1
    last_offset: int = -1
    rows: int = 0
    nbytes: int = 0
    opened_at_s: float = 0.0
    dead_letters: list = field(default_factory=list)  # send futures of this batch's dead letters

    def note(self, offset: int, now_s: float) -> None:
        if self.first_offset < 0:
            self.first_offset = offset
            self.opened_at_s = now_s
        self.last_offset = offset


@dataclass
class Seal:
    """A flush in flight: commit ``commit_to`` once ``future`` (the writer's seal) succeeds."""

    tp: Any
    first_offset: int
    commit_to: int
    future: Future
    dead_letters: list
    started_s: float


def stored_after(index: DatasetIndex, topic: str, partition: int, offset: int
                 ) -> dict[int, tuple[str, int]]:
    """offset -> (request id, chunk index) of every stored row of the partition at >= ``offset``."""
    covered: dict[int, tuple[str, int]] = {}
    for stats in index.files_after(topic, partition, offset):
        try:
            table = pq.read_table(index.data_dir / stats.path,
                                  columns=["kafka_offset", "request_id", "chunk_index"])
        except (OSError, pa.ArrowException) as exc:  # deleted meanwhile, or damaged: its rows
            # are written again (and sealing drops those the dataset has deleted)
            log.error("ingest: cannot read %s for replay detection: %s", stats.path, exc)
            continue
        for o, rid, chunk in zip(*(table.column(i).to_pylist() for i in range(3))):
            if o >= offset:
                covered[o] = (rid, chunk)
    return covered
