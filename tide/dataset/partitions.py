"""What ingest holds per topic partition between consuming a message and committing its offset.

``PartitionState``: the open data files of the current batch (one per ``date=/hour=`` folder), its
offset range, its dead letters, and ``skip_through``: the last offset the table already records
for this partition (its application transaction) when the partition was (re)assigned; messages
up to it are in the table and are skipped, so a replay after a crash writes nothing twice.
A recreated topic (offsets from 0 again) instead records ``follows``: the earlier incarnation's
offset, which its first batch's commit replaces in the table's transaction.
It also watches the stream's offsets: the capture topic has no transactions or compaction, so
every offset holds a record and a fetch that skips some is fetched again once (``gap``).
``Seal``: a batch handed to the writer thread, committed to Kafka once the table holds it.
``app_id``: the Delta application-transaction id of a partition for a consumer group, keyed by
the topic's id where the broker gives one (KIP-516): a recreated topic has a new id, so its offsets
start a new transaction instead of being read against the old topic's (``resume``).
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from tide.dataset.writer import DataFileWriter

log = logging.getLogger(__name__)

# tests only: while <dir>/pause-after-table-commit exists, a seal pauses between its table commit
# and its Kafka commit (after creating <dir>/paused-<pid>), so a test can kill it exactly there
FAULT_DIR_ENV = "TIDE_INGEST_FAULT_DIR"
REFETCH, PASS = "refetched", "passed"  # PartitionState.gap outcomes (the gap metric's labels)


def app_id(group_id: str, topic: str, partition: int, topic_id: str | None = None) -> str:
    return f"{group_id}/{topic}/{partition}" if topic_id is None else f"{group_id}/{topic}@{topic_id}/{partition}"


def id_keyed_mark(group_id: str, topic: str, partition: int) -> str:
    """A transaction recorded with every id-keyed commit: the name-keyed offset beside it mirrors
    whichever topic id wrote last, so it is no longer what a new id resumes from."""
    return f"{group_id}/{topic}/{partition}/keyed-by-topic-id"


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
    expected: int = -1  # the next offset the partition's stream should yield (-1: not known yet)
    refetched_from: int = -1  # a gap at this offset was fetched again once
    follows: int | None = None  # recreated topic: the old offset the next commit replaces (once)
    # the transaction a commit checks and advances, then those it records alongside: (app id, offset
    # or None for the batch's last offset)
    app_ids: tuple[tuple[str, int | None], ...] = ()

    @classmethod
    def after(cls, recorded: int | None, app_ids: tuple = ()) -> "PartitionState":
        """A partition whose offsets up to ``recorded`` are in the table (None: none recorded): the
        next one is what its stream must yield (``gap``)."""
        if recorded is None:
            return cls(app_ids=app_ids)
        return cls(skip_through=recorded, expected=recorded + 1, app_ids=app_ids)

    @classmethod
    def recreated(cls, recorded: int, app_ids: tuple = ()) -> "PartitionState":
        """A partition whose topic was recreated: the table records ``recorded`` from the old topic,
        which means nothing for the new one's offsets (read from the start)."""
        return cls(follows=recorded, app_ids=app_ids)

    def recorded_before(self) -> int:
        """The offset the table must record for this partition when the open batch commits."""
        return self.first_offset - 1 if self.follows is None else self.follows

    def note(self, offset: int, now_s: float) -> None:
        if self.first_offset < 0:
            self.first_offset = offset
            self.opened_at_s = now_s
        self.last_offset = offset
        self.expected = offset + 1

    def cover_gap(self, now_s: float) -> None:
        """A gap passed (PASS): an empty batch starts at the gap's first offset, so the table's
        commit of it follows the offset committed before (tide/dataset/table.py, ``append``)."""
        if self.first_offset < 0:
            self.first_offset, self.opened_at_s = self.expected, now_s

    def gap(self, offset: int) -> str:
        """What to do with ``offset`` arriving: "" (in order), REFETCH (offsets before it never
        came: fetch from ``expected`` again), or PASS (they did not come the second time either:
        go on, the topic has nothing there)."""
        if self.expected < 0 or offset <= self.expected:
            return ""
        if self.refetched_from != self.expected:
            self.refetched_from = self.expected
            return REFETCH
        return PASS


def resume(table: Any, group_id: str, tp: Any, topic_id: str | None,
           recreated: Callable[[int], bool]) -> PartitionState:
    """Where the table leaves partition ``tp`` for this group. Keyed by the topic's id: what that
    transaction records; nothing when another id wrote the partition before (a recreated topic:
    ``id_keyed_mark``); for a table written before topic ids keyed it, the name-keyed offset. Each
    id-keyed commit also records the name-keyed offset (ingest replicas of earlier versions read it
    during a rolling upgrade). Keyed by name (no topic id known): that offset, unless
    ``recreated(offset)`` says the topic was recreated since (a guess: the group has no committed
    offset and the partition ends at or before it), whose first commit then replaces it."""
    by_name = app_id(group_id, tp.topic, tp.partition)
    if topic_id is None:
        ids: tuple = ((by_name, None),)
        recorded = table.app_version(by_name)
    else:
        mark = id_keyed_mark(group_id, tp.topic, tp.partition)
        ids = ((app_id(group_id, tp.topic, tp.partition, topic_id), None), (by_name, None), (mark, 0))
        own = table.app_version(ids[0][0])
        if own is not None:
            return PartitionState.after(own, ids)
        if table.app_version(mark) is not None:
            return PartitionState.after(None, ids)  # a topic recreated since its offsets were keyed by id
        recorded = table.app_version(by_name)
    if recorded is not None and recreated(recorded):
        log.warning("ingest: %s ends before offset %d the table records for it and the group has no "
                    "committed offset: the topic was recreated; reading it from the start", tp, recorded)
        return PartitionState.recreated(recorded, ids)
    return PartitionState.after(recorded, ids)


@dataclass
class Seal:
    """A flush in flight: commit ``commit_to`` to Kafka once ``future`` (the table commit) succeeds."""

    tp: Any
    first_offset: int
    commit_to: int
    future: Future
    started_s: float


def fault_pause() -> None:
    """Tests only (``FAULT_DIR_ENV``): stop between the table commit and the Kafka commit."""
    folder = os.environ.get(FAULT_DIR_ENV)
    if not folder or not os.path.exists(os.path.join(folder, "pause-after-table-commit")):
        return
    with open(os.path.join(folder, f"paused-{os.getpid()}"), "w") as marker:
        marker.write(str(time.time()))
    deadline = time.monotonic() + 300
    while os.path.exists(os.path.join(folder, "pause-after-table-commit")) and time.monotonic() < deadline:
        time.sleep(0.05)
