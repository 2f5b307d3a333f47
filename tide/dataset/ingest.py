"""Ingest: Kafka topic -> Parquet dataset, committing offsets only for durable files.

Loop steps (consumer thread):
1. poll a batch (consumer group, auto-commit off);
2. per message: skip offsets already on disk (see below); decode; a malformed, unknown-version
   or oversized value goes to the dead-letter topic with the reason in its headers; a good chunk
   is handed to the writer thread for its partition's open file in its
   ``target_model=/date=/hour=`` directory;
3. a partition is flushed when its open files reach ``file_max_rows`` / ``file_max_bytes`` (checked
   per message) or ``roll_interval_s`` passed (checked per poll): the writer thread seals every file (fsync, rename, fsync dir) and
   indexes it while consumption goes on;
4. when a seal has completed (in order): wait for the partition's dead letters to be
   acknowledged, then commit ``last offset + 1``. A failed seal rewinds the partition to its
   first uncommitted offset;
5. every ``retention_interval_s``: retention (TTL, then size budget, oldest first).

Why no duplicates after a crash: a file holds offsets of one partition and is named by its
offset range. When a partition is first seen after (re)assignment, the offsets stored in its
files past the resume point are loaded (with each row's request id and chunk index) and skipped
when the replayed message is the same one, so a replay writes only what is missing, whatever the
batch boundaries were before. A different message at a stored offset (the topic was deleted and
recreated, e.g. an in-memory broker restarted) is written, under a differently tagged name.
Dead letters are at-least-once: a crash before the commit re-sends them. Temporary files of the crashed run are deleted at
start-up and the index is reconciled with the disk.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer
from kafka.structs import OffsetAndMetadata

from tide import metrics
from tide.config import IngestConfig, KafkaConfig
from tide.dataset.index import DatasetIndex
from tide.dataset.retention import apply_retention
from tide.dataset.schema import Row, partition_dir
from tide.dataset.writer import OpenFile, remove_temporaries
from tide.dataset.writer_thread import WriterThread
from tide.records import RecordError, decode

log = logging.getLogger(__name__)


def wanted_topics(config: IngestConfig, kafka: KafkaConfig) -> list:
    """The data and dead-letter topics (named by ``kafka``) as ingest creates them (NewTopic specs)."""
    from kafka.admin import NewTopic

    topic_configs = {"retention.ms": str(config.topic_retention_ms)} if config.topic_retention_ms else {}
    return [NewTopic(kafka.topic, config.topic_partitions, config.replication_factor, topic_configs=topic_configs),
            NewTopic(kafka.dead_letter_topic, 1, config.replication_factor, topic_configs=topic_configs)]


def ensure_topics(config: IngestConfig, kafka: KafkaConfig) -> None:
    """Create the data and dead-letter topics if missing (explicitly: auto-created topics get
    whatever partition count and retention the broker likes)."""
    from kafka import KafkaAdminClient
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers.split(","),
                             client_id="tide-ingest-admin")
    try:
        existing = set(admin.list_topics())
        missing = [t for t in wanted_topics(config, kafka) if t.name not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass  # created concurrently by another ingest replica
    finally:
        admin.close()


@dataclass
class _PartitionState:
    """Consumed work of one topic partition not yet handed to a seal."""

    # offset -> (request id, chunk index) of rows already durable in files: a replay after a
    # crash matches; a different message at a covered offset means the topic was recreated
    covered: dict[int, tuple[str, int]]
    files: dict[str, OpenFile] = field(default_factory=dict)
    first_offset: int = -1
    last_offset: int = -1
    rows: int = 0
    nbytes: int = 0
    opened_at_s: float = 0.0
    dead_lettered: bool = False

    def note(self, offset: int, now_s: float) -> None:
        if self.first_offset < 0:
            self.first_offset = offset
            self.opened_at_s = now_s
        self.last_offset = offset


@dataclass
class _Seal:
    """A flush in flight: commit ``commit_to`` once ``future`` (the writer's seal) succeeds."""

    tp: Any
    first_offset: int
    commit_to: int
    future: "Future"
    dead_lettered: bool
    started_s: float


class Ingestor:
    """Consumes ``kafka.topic`` into ``data_dir``; ``run`` until the stop event is set."""

    def __init__(self, config: IngestConfig, kafka: KafkaConfig, data_dir: str | Path) -> None:
        self.config = config
        self.kafka = kafka
        self.data_dir = Path(data_dir)
        self.index: DatasetIndex | None = None
        self._writer: WriterThread | None = None
        self._consumer: Any = None
        self._dead_letters: Any = None
        self._parts: dict[Any, _PartitionState] = {}
        self._seals: deque[_Seal] = deque()
        self._last_retention_s = time.monotonic()
        self._last_poll_s: float | None = None
        self.last_error = ""  # why the last open() failed (the service retries it)

    # --- lifecycle ------------------------------------------------------------------------------
    def open(self) -> None:
        """Clean crash leftovers, reconcile the index, create topics, join the group."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        removed = remove_temporaries(self.data_dir)
        self.index = DatasetIndex(self.data_dir)
        added, dropped = self.index.reconcile()
        if removed or added or dropped:
            log.info("ingest: removed %d temporary files; index +%d -%d", removed, added, dropped)
        self._writer = WriterThread(self.index)
        # pyarrow imports pandas on its first conversion of Python objects (~0.5 s): pay it now,
        # not with the first row group
        pa.array(["warm-up"], pa.string())
        if self.config.create_topics:
            ensure_topics(self.config, self.kafka)
        c, k = self.config, self.kafka
        self._dead_letters = KafkaProducer(
            bootstrap_servers=k.bootstrap_servers.split(","), acks="all", enable_idempotence=True,
            compression_type="zstd", linger_ms=5, client_id="tide-ingest-dead-letter",
            max_request_size=c.dead_letter_max_bytes + 64 * 1024)
        self._consumer = KafkaConsumer(
            bootstrap_servers=k.bootstrap_servers.split(","), group_id=c.group_id,
            client_id="tide-ingest", enable_auto_commit=False, auto_offset_reset="earliest",
            session_timeout_ms=c.session_timeout_ms, heartbeat_interval_ms=c.heartbeat_interval_ms,
            max_poll_records=c.max_poll_records, fetch_max_bytes=c.fetch_max_bytes,
            max_partition_fetch_bytes=c.max_partition_fetch_bytes)
        self._consumer.subscribe([k.topic], listener=_Rebalance(self))
        self._update_dataset_gauges()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.poll_once()

    def poll_once(self) -> int:
        """One poll + the flushes, commits and retention it makes due; returns messages handled."""
        self._last_poll_s = time.monotonic()
        batch = self._consumer.poll(timeout_ms=int(self.config.poll_timeout_s * 1000))
        handled = 0
        for tp, messages in batch.items():
            for message in messages:
                self._handle(tp, message)
                handled += 1
        self._flush_due(time.monotonic())
        self._settle_seals(wait=False)
        if time.monotonic() - self._last_retention_s > self.config.retention_interval_s:
            self._last_retention_s = time.monotonic()
            self.retention()
        return handled

    def health(self) -> tuple[bool, dict]:
        """Ready = joined and polling: a loop that has not polled for ``max(30 s, 20 polls)``
        is stuck (a hung flush, a wedged broker call) even though its /metrics still answer."""
        if self._consumer is None or self._last_poll_s is None:
            return False, {"state": "connecting", "last_error": self.last_error}
        age_s = time.monotonic() - self._last_poll_s
        stalled = age_s > max(30.0, 20 * self.config.poll_timeout_s)
        return not stalled, {"state": "stalled" if stalled else "consuming", "last_poll_age_s": round(age_s, 1),
                             "open_partitions": len(self._parts), "seals_in_flight": len(self._seals)}

    def close(self, flush: bool = True) -> None:
        """Seal and commit open files (graceful stop), then leave the group."""
        try:
            if flush and self._consumer is not None:
                for tp in list(self._parts):
                    self._flush(tp)
                self._settle_seals(wait=True)
        finally:
            if self._consumer is not None:
                self._consumer.close(autocommit=False)
            if self._writer is not None:
                self._writer.close()
            if self._dead_letters is not None:
                self._dead_letters.close(timeout=5)
            if self.index is not None:
                self.index.close()
            self._consumer = self._dead_letters = self.index = self._writer = None
            self._last_poll_s = None
            self._parts.clear()
            self._seals.clear()

    # --- messages -------------------------------------------------------------------------------
    def _state(self, tp: Any, offset: int) -> _PartitionState:
        state = self._parts.get(tp)
        if state is None:
            self._writer.wait_idle()  # seals still in flight must be on disk before we look
            covered: dict[int, tuple[str, int]] = {}
            for stats in self.index.files_after(tp.topic, tp.partition, offset):
                table = pq.read_table(self.data_dir / stats.path,
                                      columns=["kafka_offset", "request_id", "chunk_index"])
                for o, rid, chunk in zip(*(table.column(i).to_pylist() for i in range(3))):
                    if o >= offset:
                        covered[o] = (rid, chunk)
            state = self._parts[tp] = _PartitionState(covered=covered)
            if state.covered:
                log.info("ingest: %s resumes at %d; %d later offsets already on disk",
                         tp, offset, len(state.covered))
        return state

    def _handle(self, tp: Any, message: Any) -> None:
        state = self._state(tp, message.offset)
        state.note(message.offset, time.monotonic())
        stored = state.covered.pop(message.offset, None)
        try:
            if message.value is None:
                raise RecordError("empty value")
            record = decode(message.value, max_bytes=self.config.max_record_bytes)
        except RecordError as exc:
            self._dead_letter(message, exc.reason, str(exc))
            state.dead_lettered = True
            return
        if stored is not None:
            if stored == (record.request_id, record.chunk_index):
                metrics.INGEST_MESSAGES.labels("duplicate").inc()
                return
            log.warning("ingest: %s offset %d held %s on disk but now %s: topic recreated? "
                        "writing it", tp, message.offset, stored,
                        (record.request_id, record.chunk_index))
        row = Row(record, message.topic, message.partition, message.offset,
                  message.timestamp, time.time())
        rel = partition_dir(record.target_model_id, record.finished_at_s)
        open_file = state.files.get(rel)
        if open_file is None:
            open_file = state.files[rel] = OpenFile(
                self.data_dir, rel, message.topic, message.partition,
                self.config.row_group_rows, self.config.row_group_bytes)
        self._writer.add(open_file, row)
        state.rows += 1
        state.nbytes += row.nbytes
        metrics.INGEST_MESSAGES.labels("written").inc()
        if state.rows >= self.config.file_max_rows or state.nbytes >= self.config.file_max_bytes:
            self._flush(tp)

    def _dead_letter(self, message: Any, reason: str, detail: str) -> None:
        value = message.value or b""
        headers = [("tide-dead-letter-reason", reason.encode()),
                   ("tide-dead-letter-detail", detail[:500].encode()),
                   ("tide-source-topic", message.topic.encode()),
                   ("tide-source-partition", str(message.partition).encode()),
                   ("tide-source-offset", str(message.offset).encode())]
        if len(value) > self.config.dead_letter_max_bytes:
            headers.append(("tide-dead-letter-truncated-from", str(len(value)).encode()))
            value = value[:self.config.dead_letter_max_bytes]
        log.warning("ingest: dead-lettering %s-%d@%d: %s (%s)", message.topic, message.partition,
                    message.offset, reason, detail)
        self._dead_letters.send(self.kafka.dead_letter_topic, key=message.key, value=value,
                                headers=headers)
        metrics.INGEST_MESSAGES.labels("dead_lettered").inc()
        metrics.INGEST_DEAD_LETTERED.labels(reason).inc()

    # --- flushing -------------------------------------------------------------------------------
    def _flush_due(self, now: float) -> None:
        for tp, state in list(self._parts.items()):
            if state.first_offset >= 0 and now - state.opened_at_s >= self.config.roll_interval_s:
                self._flush(tp)
        lag = sum(s.commit_to - s.first_offset for s in self._seals)
        lag += sum(s.last_offset - s.first_offset + 1 for s in self._parts.values()
                   if s.first_offset >= 0)
        metrics.INGEST_COMMIT_LAG.set(lag)

    def _flush(self, tp: Any) -> None:
        """Hand the partition's open files to the writer for sealing; commit when it is done."""
        state = self._parts.get(tp)
        if state is None or state.first_offset < 0:
            return
        future = self._writer.seal(list(state.files.values()), time.time())
        self._seals.append(_Seal(tp, state.first_offset, state.last_offset + 1, future,
                                 state.dead_lettered, time.monotonic()))
        state.files, state.first_offset, state.rows, state.nbytes = {}, -1, 0, 0
        state.dead_lettered = False

    def _settle_seals(self, wait: bool) -> None:
        """Commit completed seals in order; rewind the partition of a failed one."""
        while self._seals and (wait or self._seals[0].future.done()):
            seal = self._seals.popleft()
            try:
                sealed = seal.future.result()
                if seal.dead_lettered:
                    self._dead_letters.flush(timeout=30)
            except Exception as exc:  # disk full, dead-letter topic unreachable, ...
                log.error("ingest: flush of %s failed (%s); rewinding to offset %d", seal.tp, exc,
                          seal.first_offset)
                metrics.INGEST_COMMITS.labels("write_error").inc()
                self._rewind(seal.tp, seal.first_offset)
                continue
            for stats in sealed:
                metrics.INGEST_FILES.inc()
                metrics.INGEST_FILE_BYTES.inc(stats.bytes)
                metrics.INGEST_ROWS.inc(stats.rows)
                metrics.INGEST_TOKENS.inc(stats.tokens)
            try:
                self._consumer.commit({seal.tp: OffsetAndMetadata(seal.commit_to, "", -1)},
                                      timeout_ms=10_000)
                metrics.INGEST_COMMITS.labels("ok").inc()
                metrics.INGEST_LAST_COMMIT.set(time.time())
            except Exception as exc:  # the files are durable: a replay of them is skipped
                log.warning("ingest: commit of %s at %d failed: %s", seal.tp, seal.commit_to, exc)
                metrics.INGEST_COMMITS.labels("commit_error").inc()
            metrics.INGEST_FLUSH_SECONDS.observe(time.monotonic() - seal.started_s)
            if sealed:
                self._update_dataset_gauges()

    def _rewind(self, tp: Any, offset: int) -> None:
        """Drop everything held for ``tp`` after ``offset`` and consume it again."""
        state = self._parts.pop(tp, None)
        if state is not None:
            self._writer.discard(list(state.files.values()))
        self._seals = deque(s for s in self._seals if s.tp != tp)  # later seals: re-done
        self._writer.wait_idle()
        self.index.reconcile()
        time.sleep(1.0)  # a failing disk or broker should not be hammered
        try:
            self._consumer.seek(tp, offset)
        except Exception:
            log.exception("ingest: seek of %s failed", tp)

    def forget_partitions(self, partitions: Any) -> None:
        """Rebalance: discard what we hold for partitions we lose; the new owner replays it
        (anything already sealed is skipped by its offsets on disk). Committing here is not an
        option: kafka-python runs these callbacks on its IO loop, where commit() cannot run."""
        lost = set(partitions)
        for tp in lost:
            state = self._parts.pop(tp, None)
            if state is not None:
                self._writer.discard(list(state.files.values()))
        self._seals = deque(s for s in self._seals if s.tp not in lost)

    # --- maintenance ----------------------------------------------------------------------------
    def retention(self) -> None:
        self._writer.wait_idle()
        deleted = apply_retention(self.data_dir, self.index, self.config.retention_ttl_s,
                                  self.config.retention_max_bytes)
        if deleted:
            log.info("ingest: retention deleted %d files", len(deleted))
        self._update_dataset_gauges()

    def _update_dataset_gauges(self) -> None:
        files, nbytes = self.index.totals()
        metrics.INGEST_DATASET_FILES.set(files)
        metrics.INGEST_DATASET_BYTES.set(nbytes)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, ingestor: Ingestor) -> None:
        self.ingestor = ingestor

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.ingestor.forget_partitions(revoked)

    def on_partitions_assigned(self, assigned: Any) -> None:
        # offsets already on disk are loaded lazily at each partition's first message
        self.ingestor.forget_partitions(assigned)
