"""Ingest: Kafka topic -> the dataset's Delta table, exactly once, several replicas in one group.

Loop steps (consumer thread):
1. poll a batch (consumer group, auto-commit off);
2. per message: at a partition's first message after (re)assignment, read its application
   transaction in the table (app id = group/topic/partition, version = the last offset it holds)
   and seek past it; a fetch that skipped offsets is fetched again once (``PartitionState.gap``);
   decode; a malformed, unknown-version, oversized or invalid value (any per-record failure:
   ``unprocessable``) goes to the dead-letter topic with the reason in its headers; a good chunk
   goes to the writer thread for its partition's open data file in its ``date=/hour=`` folder;
3. a partition's batch is sealed when its files reach ``file_max_rows`` / ``file_max_bytes``
   (checked per message) or ``roll_interval_s`` passed (checked per poll): the writer thread
   finishes the files, waits for the batch's dead letters, and commits the files to the table
   with the partition's transaction (version = the batch's last offset) while consumption goes on;
4. when a seal has completed (in order): commit ``last offset + 1`` to Kafka. A failed seal (the
   store full or unreachable, a dead letter refused) rewinds the partition to its first
   uncommitted offset and stops consumption (``backoff.WriteBackoff``: 1 s, 2 s, 4 s ... up to
   ``write_backoff_max_s``), so nothing is committed anywhere that is not in the table.

Why no duplicates: the table commit and the offset it covers are one atomic Delta commit. A
replica that dies between the table commit and the Kafka commit leaves Kafka behind the table;
whoever gets the partition next (itself restarted, or another replica after the rebalance) reads
the transaction and resumes after it. A replica that still writes a partition it lost (a zombie
after a rebalance) cannot commit it twice either: the commit checks the recorded version first,
and two commits of one app id conflict in Delta (the loser re-checks, finds its offsets taken,
and seeks past them: ``Stale``). Dead letters are at-least-once (acknowledged before the table
commit; a crash before it re-sends them). Retention and compaction are the scheduler's
(tide/dataset/retention.py): a late record older than the TTL goes at its next pass.
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
from tide.dataset.location import Location
from tide.dataset.partitions import PASS, PartitionState, Seal, fault_pause, resume
from tide.dataset.schema import Row, partition_path, partition_values
from tide.dataset.table import DatasetTable
from tide.dataset.tombstones import Tombstones
from tide.dataset.topics import TopicIdUnknown, ensure_topics, topic_id
from tide.dataset.writer import DataFileWriter
from tide.dataset.writer_thread import Batch, WriterThread
from tide.records import RecordError, decode

log = logging.getLogger(__name__)


class Ingestor:
    """Consumes ``kafka.topic`` into the table at ``location``; ``run`` until the stop event is set."""

    def __init__(self, config: IngestConfig, kafka: KafkaConfig, location: Location | str | Path) -> None:
        self.config = config
        self.kafka = kafka
        self.location = location if isinstance(location, Location) else Location.from_uri(location, config.storage_options)
        self.table: DatasetTable | None = None  # the consumer thread's reads
        self._writer: WriterThread | None = None
        self._consumer: Any = None
        self._dead_letters: Any = None
        self._parts: dict[Any, PartitionState] = {}
        self._topic_ids: dict[str, str | None] = {}  # topic -> its id (None: the broker gives none)
        self._seals: deque[Seal] = deque()
        self._rewind_to: dict[Any, int] = {}  # partitions revoked with work discarded: where it began
        self._last_gauges_s = time.monotonic()
        self._last_poll_s: float | None = None
        self._backoff = WriteBackoff(config.write_backoff_initial_s, config.write_backoff_max_s)
        self._paused_partitions = 0  # for /health (read on its thread)
        self.last_error = ""  # why the last open() failed (the service retries it)

    # --- lifecycle ------------------------------------------------------------------------------
    def open(self) -> None:
        """Create the table if missing, create topics, join the group."""
        self.table = DatasetTable(self.location)
        self.table.ensure()
        # pyarrow imports pandas on its first conversion of Python objects: pay it now, not with the first row group
        pa.array(["warm-up"], pa.string())
        if self.config.create_topics:
            ensure_topics(self.config, self.kafka)
        c, k = self.config, self.kafka
        self._dead_letters = DeadLetters(c, k)
        self._writer = WriterThread(DatasetTable(self.location), Tombstones(self.location),
                                    self._dead_letters.confirm)
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
        """One poll + the flushes and commits it makes due; returns messages handled.
        While writes are failing, the poll only heartbeats (every partition is paused)."""
        self._last_poll_s = time.monotonic()
        if self._backoff.due(self._last_poll_s):
            self._resume()
        joining = not self._consumer.assignment()  # a join must complete inside one poll (config)
        timeout_s = self.config.join_poll_timeout_s if joining else self.config.poll_timeout_s
        batch = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        handled = 0
        for tp, messages in batch.items():
            for message in messages:
                try:
                    if not self._handle(tp, message):
                        break  # the rest of this partition's batch is in the table, or fetched again
                except (DeadLetterFailed, TopicIdUnknown) as exc:  # the rest of this batch is fetched again
                    self._write_failed(tp, self._first_uncommitted(tp, message.offset), exc)
                    break
                handled += 1
        self._flush_due(time.monotonic())
        self._settle_seals(wait=False)
        if time.monotonic() - self._last_gauges_s > self.config.retention_interval_s:
            self._last_gauges_s = time.monotonic()
            self._update_dataset_gauges()
        return handled

    def positions(self) -> dict[Any, int]:
        """The next offset to consume of each partition assigned to this replica (benchmarks)."""
        return {tp: self._consumer.position(tp) for tp in self._consumer.assignment()}

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
            self._consumer = self._dead_letters = self.table = self._writer = None
            self._last_poll_s = None
            self._parts.clear()
            self._seals.clear()

    # --- messages -------------------------------------------------------------------------------
    def _state(self, tp: Any) -> PartitionState:
        state = self._parts.get(tp)
        if state is None:
            self._writer.wait_idle()  # seals still in flight must be in the table before we look
            if tp.topic not in self._topic_ids:  # once per assignment: a recreated topic has a new id
                self._topic_ids[tp.topic] = topic_id(self.kafka, tp.topic)
            state = self._parts[tp] = resume(self.table, self.config.group_id, tp, self._topic_ids[tp.topic],
                                             lambda recorded: self._topic_recreated(tp, recorded))
        return state

    def _topic_recreated(self, tp: Any, recorded: int) -> bool:
        """A broker that lost the topic (an in-memory one restarted) starts at offset 0 again, without the group's offsets."""
        try:
            return self._consumer.committed(tp) is None and self._consumer.end_offsets([tp])[tp] <= recorded
        except Exception:  # noqa: BLE001 - cannot tell: trust the table
            return False

    def _handle(self, tp: Any, message: Any) -> bool:
        """Handle one message; False when it (and the rest of the partition's batch) is already in
        the table and the partition was moved past it."""
        state = self._state(tp)
        if message.offset <= state.skip_through:
            metrics.INGEST_MESSAGES.labels("duplicate").inc()
            log.info("ingest: %s offsets up to %d are already in the table; resuming after them",
                     tp, state.skip_through)
            self._consumer.seek(tp, state.skip_through + 1)
            state.expected = state.skip_through + 1
            try:  # the group catches up with the table (its lag would stay until the next batch)
                self._consumer.commit({tp: OffsetAndMetadata(state.skip_through + 1, "", -1)}, timeout_ms=10_000)
            except Exception as exc:  # noqa: BLE001 - the next batch's commit covers it
                log.warning("ingest: commit of %s at %d failed: %s", tp, state.skip_through + 1, exc)
            return False
        if self._gap(tp, state, message.offset):
            return False
        state.note(message.offset, time.monotonic())
        try:
            record, part = self._route(message)
        except RecordError as exc:
            self._dead_letter(state, message, exc.reason, str(exc))
            return True
        except Exception as exc:  # unforeseen, but one record must never stop ingest
            log.exception("ingest: %s-%d@%d failed unexpectedly", message.topic, message.partition,
                          message.offset)
            self._dead_letter(state, message, DEAD_UNPROCESSABLE, f"{type(exc).__name__}: {exc}")
            return True
        row = Row(record, message.topic, message.partition, message.offset,
                  message.timestamp, time.time())
        key = partition_path(part)
        data_file = state.files.get(key)
        if data_file is None:
            data_file = state.files[key] = DataFileWriter(self.location, part, self.config.row_group_rows,
                                                          self.config.row_group_bytes)
        self._writer.add(data_file, row)
        state.rows += 1
        state.nbytes += row.nbytes
        metrics.INGEST_MESSAGES.labels("written").inc()
        if state.rows >= self.config.file_max_rows or state.nbytes >= self.config.file_max_bytes:
            self._flush(tp)
        return True

    def _gap(self, tp: Any, state: PartitionState, offset: int) -> bool:
        """True when offsets before ``offset`` never came and are fetched again (PartitionState.gap)."""
        outcome = state.gap(offset)
        if not outcome:
            return False
        metrics.INGEST_OFFSET_GAPS.labels(outcome).inc()
        if outcome == PASS:
            log.error("ingest: %s offsets %d..%d missing twice from the broker's answers; going on",
                      tp, state.expected, offset - 1)
            state.cover_gap(time.monotonic())  # the batch spans the gap: the table's offsets stay contiguous
            return False
        log.warning("ingest: %s offsets %d..%d missing from a fetch; fetching again", tp, state.expected, offset - 1)
        self._consumer.seek(tp, state.expected)
        return True

    def _route(self, message: Any) -> tuple[Any, dict[str, str]]:
        """Decode and place one message: (record, its table partition), or RecordError."""
        if message.value is None:
            raise RecordError("empty value")
        record = decode(message.value, max_bytes=self.config.max_record_bytes)
        if record.finished_at_s > time.time() + self.config.max_clock_skew_s:
            raise RecordError(f"finished_at_s={record.finished_at_s} is more than "
                              f"{self.config.max_clock_skew_s:.0f} s in the future", DEAD_INVALID)
        return record, partition_values(record.finished_at_s)

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
        """Hand the partition's batch to the writer for its table commit; commit Kafka when done."""
        state = self._parts.get(tp)
        if state is None or state.first_offset < 0:
            return
        batch = Batch(list(state.files.values()), state.app_ids, state.first_offset, state.last_offset,
                      state.dead_letters, state.recorded_before())
        self._seals.append(Seal(tp, state.first_offset, state.last_offset + 1, self._writer.seal(batch),
                                time.monotonic()))
        state.files, state.first_offset, state.rows, state.nbytes = {}, -1, 0, 0
        state.dead_letters, state.follows = [], None

    def _settle_seals(self, wait: bool) -> None:
        """Commit completed seals in order; rewind the partition of a failed one and back off."""
        while self._seals and (wait or self._seals[0].future.done()):
            seal = self._seals.popleft()
            try:
                sealed = seal.future.result()
            except Exception as exc:  # store full or unreachable, dead-letter topic refusing, ...
                log.error("ingest: flush of %s failed (%s); rewinding to offset %d", seal.tp, exc,
                          seal.first_offset)
                metrics.INGEST_COMMITS.labels("write_error").inc()
                self._write_failed(seal.tp, seal.first_offset, exc)
                continue
            self._backoff.succeeded()
            if sealed.stale_at is not None:  # another replica committed these offsets
                log.warning("ingest: %s offsets up to %d were committed by another replica; skipping "
                            "past them", seal.tp, sealed.stale_at)
                metrics.INGEST_COMMITS.labels("stale").inc()
                self._rewind(seal.tp, sealed.stale_at + 1)
                continue
            for out in sealed.files:
                metrics.INGEST_FILES.inc()
                metrics.INGEST_FILE_BYTES.inc(out.nbytes)
                metrics.INGEST_ROWS.inc(out.rows)
                metrics.INGEST_TOKENS.inc(sum(c["tokens"] for c in out.counts.values()))
            fault_pause()
            try:
                self._consumer.commit({seal.tp: OffsetAndMetadata(seal.commit_to, "", -1)},
                                      timeout_ms=10_000)
                metrics.INGEST_COMMITS.labels("ok").inc()
                metrics.INGEST_LAST_COMMIT.set(time.time())
            except Exception as exc:  # the table holds them: a replay skips them
                log.warning("ingest: commit of %s at %d failed: %s", seal.tp, seal.commit_to, exc)
                metrics.INGEST_COMMITS.labels("commit_error").inc()
            metrics.INGEST_FLUSH_SECONDS.observe(time.monotonic() - seal.started_s)

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
        """End of a backoff: consume again (the next seal tells whether writing works)."""
        self._writer.wait_idle()
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
        """Rebalance: discard what we hold for partitions we lose; the new owner consumes it
        again (what reached the table is skipped by its transaction). Committing here is not an
        option: kafka-python runs these callbacks on its IO loop, where commit() cannot run. A
        partition we get back keeps its fetch position (kafka-python keeps it across a
        rebalance), so ``partitions_assigned`` seeks it back to what we discarded."""
        lost = set(partitions)
        for tp in lost:
            held = [s.first_offset for s in self._seals if s.tp == tp]
            state = self._parts.pop(tp, None)
            if state is not None:
                self._writer.discard(list(state.files.values()))
                held += [state.first_offset] if state.first_offset >= 0 else []
            if held:
                self._rewind_to[tp] = min(held + [self._rewind_to.get(tp, held[0])])
        self._seals = deque(s for s in self._seals if s.tp not in lost)

    def partitions_assigned(self, partitions: Any) -> None:
        self.forget_partitions(partitions)
        self._topic_ids.clear()  # looked up again at the partitions' first messages
        for tp in partitions:  # seek() is allowed here: it only moves the local position
            if tp in self._rewind_to:
                self._consumer.seek(tp, self._rewind_to[tp])
        self._rewind_to.clear()
        if self._backoff.blocked:  # a new assignment starts unpaused
            self._consumer.pause(*partitions)
            self._paused_partitions = len(self._consumer.paused())

    def _update_dataset_gauges(self) -> None:
        try:
            files = self.table.data_files()
        except Exception as exc:  # noqa: BLE001 - a gauge must not stop ingest
            log.warning("ingest: cannot read the table log for its gauges: %s", exc)
            return
        metrics.INGEST_DATASET_FILES.set(len(files))
        metrics.INGEST_DATASET_BYTES.set(sum(f.size for f in files))


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, ingestor: Ingestor) -> None:
        self.ingestor = ingestor

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.ingestor.forget_partitions(revoked)

    def on_partitions_assigned(self, assigned: Any) -> None:
        # the table's transaction is read at each partition's first message (not on the IO loop)
        self.ingestor.partitions_assigned(assigned)
