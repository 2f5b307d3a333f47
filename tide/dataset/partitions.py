"""What ingest holds per topic partition between consuming a message and committing its offset.

``PartitionState``: the open data files of the current batch (one per ``date=/hour=`` folder), its
offset range, its dead letters, and ``skip_through``: the last offset the table already records
for this partition (its application transaction) when the partition was (re)assigned; messages
up to it are in the table and are skipped, so a replay after a crash writes nothing twice.
``Seal``: a batch handed to the writer thread, committed to Kafka once the table holds it.
``app_id``: the Delta application-transaction id of a partition for a consumer group.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tide.dataset.writer import DataFileWriter


def app_id(group_id: str, topic: str, partition: int) -> str:
    return f"{group_id}/{topic}/{partition}"


@dataclass
class PartitionState:
    """Consumed work of one topic partition not yet handed to a seal."""

    skip_through: int = -1  # offsets up to this are already in the table
    files: dict[str, DataFileWriter] = field(default_factory=dict)
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
    """A flush in flight: commit ``commit_to`` to Kafka once ``future`` (the table commit) succeeds."""

    tp: Any
    first_offset: int
    commit_to: int
    future: Future
    started_s: float
