"""Ingest: Kafka topic -> Parquet dataset, committing offsets only for durable files.

Loop steps (consumer thread):
1. poll a batch (consumer group, auto-commit off);
2. per message: skip offsets already on disk (see below); decode; a malformed, unknown-version,
   oversized or invalid value (and any other per-record failure: ``unprocessable``) goes to the
   dead-letter topic with the reason in its headers; a good chunk is handed to the writer thread
   for its partition's open file in its ``target_model=/date=/hour=`` directory;
3. a partition is flushed when its open files reach ``file_max_rows`` / ``file_max_bytes`` (checked
   per message) or ``roll_interval_s`` passed (checked per poll): the writer thread seals every file (fsync, rename, fsync dir) and
   indexes it while consumption goes on;
4. when a seal has completed (in order): wait for the partition's dead letters to be
   acknowledged, then commit ``last offset + 1``. A failed seal (or dead letter) rewinds the
   partition to its first uncommitted offset and stops consumption (``backoff.WriteBackoff``:
   a full disk waits 1 s, 2 s, 4 s ... up to ``write_backoff_max_s``; the index is reconciled
   before consuming again), so nothing is committed that is not on disk;
5. every ``retention_interval_s``: retention (TTL, then size budget, oldest first), unless a
   ``tide data`` command holds the dataset lock.

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
from pathlib import Path
from typing import Any

import pyarrow as pa
from kafka import ConsumerRebalanceListener, KafkaConsumer
from kafka.structs import OffsetAndMetadata

from tide import metrics
from tide.config import IngestConfig, KafkaConfig
from tide.contracts import DEAD_INVALID, DEAD_UNPROCESSABLE
from tide.dataset.backoff import WriteBackoff
from tide.dataset.dead_letter import DeadLetterFailed, DeadLetters
from tide.dataset.index import DatasetIndex
from tide.dataset.lock import LockBusy
from tide.dataset.partitions import PartitionState, Seal, stored_after
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
        self._parts: dict[Any, PartitionState] = {}
        self._seals: deque[Seal] = deque()
        self._last_retention_s = time.monotonic()
        self._last_poll_s: float | None = None
        self._backoff = WriteBackoff(config.write_backoff_initial_s, config.write_backoff_max_s)
        self._paused_partitions = 0  # for /health (read on its thread)
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
        self._dead_letters = DeadLetters(c, k)
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
        """One poll + the flushes, commits and retention it makes due; returns messages handled.
        While writes are failing, the poll only heartbeats (every partition is paused)."""
        self._last_poll_s = time.monotonic()
        if self._backoff.due(self._last_poll_s):
            self._resume()
        batch = self._consumer.poll(timeout_ms=int(self.config.poll_timeout_s * 1000))
        handled = 0
        for tp, messages in batch.items():
            for message in messages:
                try:
                    self._handle(tp, message)
                except DeadLetterFailed as exc:  # the rest of this batch is fetched again
                    self._write_failed(tp, self._first_uncommitted(tp, message.offset), exc)
                    break
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
        now = time.monotonic()
        age_s = now - self._last_poll_s
        stalled = age_s > max(30.0, 20 * self.config.poll_timeout_s)
        details = {"state": "stalled" if stalled else "consuming", "last_poll_age_s": round(age_s, 1),
                   "open_partitions": len(self._parts), "seals_in_flight": len(self._seals)}
        if self._backoff.failing and not stalled:  # disk_full | write_error: not ready
            return False, {**details, **self._backoff.details(now),
                           "paused_partitions": self._paused_partitions}
        return not stalled, details

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
                self._dead_letters.close()
            if self.index is not None:
                self.index.close()
            self._consumer = self._dead_letters = self.index = self._writer = None
            self._last_poll_s = None
            self._parts.clear()
            self._seals.clear()

    # --- messages -------------------------------------------------------------------------------
    def _state(self, tp: Any, offset: int) -> PartitionState:
        state = self._parts.get(tp)
        if state is None:
            self._writer.wait_idle()  # seals still in flight must be on disk before we look
            covered = stored_after(self.index, tp.topic, tp.partition, offset)
            state = self._parts[tp] = PartitionState(covered=covered)
            if state.covered:
                log.info("ingest: %s resumes at %d; %d later offsets already on disk",
                         tp, offset, len(state.covered))
        return state

    def _handle(self, tp: Any, message: Any) -> None:
        state = self._state(tp, message.offset)
        state.note(message.offset, time.monotonic())
        stored = state.covered.pop(message.offset, None)
        try:
            record, rel = self._route(message)
        except RecordError as exc:
            self._dead_letter(state, message, exc.reason, str(exc))
            return
        except Exception as exc:  # unforeseen, but one record must never stop ingest
            log.exception("ingest: %s-%d@%d failed unexpectedly", message.topic, message.partition,
                          message.offset)
            self._dead_letter(state, message, DEAD_UNPROCESSABLE, f"{type(exc).__name__}: {exc}")
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

    def _route(self, message: Any) -> tuple[Any, str]:
        """Decode and place one message: (record, its partition directory), or RecordError."""
        if message.value is None:
            raise RecordError("empty value")
        record = decode(message.value, max_bytes=self.config.max_record_bytes)
        if record.finished_at_s > time.time() + self.config.max_clock_skew_s:
            raise RecordError(f"finished_at_s={record.finished_at_s} is more than "
                              f"{self.config.max_clock_skew_s:.0f} s in the future", DEAD_INVALID)
        return record, partition_dir(record.target_model_id, record.finished_at_s)

    def _dead_letter(self, state: PartitionState, message: Any, reason: str, detail: str) -> None:
        state.dead_letters.append(self._dead_letters.send(message, reason, detail))
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
        self._seals.append(Seal(tp, state.first_offset, state.last_offset + 1, future,
                                 state.dead_letters, time.monotonic()))
        state.files, state.first_offset, state.rows, state.nbytes = {}, -1, 0, 0
        state.dead_letters = []

    def _settle_seals(self, wait: bool) -> None:
        """Commit completed seals in order; rewind the partition of a failed one and back off."""
        while self._seals and (wait or self._seals[0].future.done()):
            seal = self._seals.popleft()
            try:
                sealed = seal.future.result()
                self._dead_letters.confirm(seal.dead_letters)
            except Exception as exc:  # disk full, dead-letter topic unreachable, ...
                log.error("ingest: flush of %s failed (%s); rewinding to offset %d", seal.tp, exc,
                          seal.first_offset)
                metrics.INGEST_COMMITS.labels("write_error").inc()
                self._write_failed(seal.tp, seal.first_offset, exc)
                continue
            self._backoff.succeeded()
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

    def _first_uncommitted(self, tp: Any, offset: int) -> int:
        """The oldest offset of ``tp`` held but not committed (``offset`` if none is older)."""
        held = [s.first_offset for s in self._seals if s.tp == tp]
        state = self._parts.get(tp)
        if state is not None and state.first_offset >= 0:
            held.append(state.first_offset)
        return min([offset, *held])

    def _write_failed(self, tp: Any, offset: int, exc: BaseException) -> None:
        """Consume ``tp`` again from ``offset``, and nothing at all until the backoff ends."""
        self._rewind(tp, offset)
        self._backoff.failed(exc, time.monotonic())
        self._consumer.pause(*self._consumer.assignment())
        self._paused_partitions = len(self._consumer.paused())

    def _resume(self) -> None:
        """End of a backoff: make the index match the disk (a seal may have renamed its file but
        not indexed it, and replay detection reads the index), then consume again."""
        try:
            self._writer.wait_idle()
            self.index.reconcile()
        except Exception as exc:  # still full: wait twice as long
            self._backoff.retrying()
            self._backoff.failed(exc, time.monotonic())
            return
        self._backoff.retrying()
        self._consumer.resume(*self._consumer.paused())
        self._paused_partitions = 0

    def _rewind(self, tp: Any, offset: int) -> None:
        """Drop everything held for ``tp`` after ``offset`` and consume it again."""
        state = self._parts.pop(tp, None)
        if state is not None:
            self._writer.discard(list(state.files.values()))
        self._seals = deque(s for s in self._seals if s.tp != tp)  # later seals: re-done
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

    def partitions_assigned(self, partitions: Any) -> None:
        self.forget_partitions(partitions)
        if self._backoff.blocked:  # a new assignment starts unpaused
            self._consumer.pause(*partitions)
            self._paused_partitions = len(self._consumer.paused())

    # --- maintenance ----------------------------------------------------------------------------
    def retention(self) -> None:
        """One retention pass, skipped (tried again next interval) while a ``tide data`` command
        holds the dataset lock or when it fails (e.g. a full disk refuses the index's update)."""
        self._writer.wait_idle()
        try:
            deleted = apply_retention(self.data_dir, self.index, self.config.retention_ttl_s,
                                      self.config.retention_max_bytes, blocking=False)
        except LockBusy:
            log.info("ingest: dataset locked by another process; retention next time")
            return
        except Exception:
            log.exception("ingest: retention failed; trying again in %.0f s",
                          self.config.retention_interval_s)
            return
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
        self.ingestor.partitions_assigned(assigned)
