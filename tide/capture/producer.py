"""The capture producer thread: queue of staged steps -> records -> Kafka.

Runs inside the capture worker process (``tide.capture.worker``), never in the engine's.
Loop steps (one background thread of the worker):
1. take a step from the tap's queue (short timeout so housekeeping runs when idle);
2. add it to its request's ``PendingRequest``; abandon requests the tap marked broken, requests
   with a position gap, and requests idle for ``request_idle_timeout_s`` (all counted);
3. when a request completes: build the record, split it into chunks under
   ``max_message_bytes``, and send each chunk (key = request id, so chunks stay in order on one
   partition) with kafka-python: acks=all, idempotent, compressed, batched by linger;
4. bounded buffering: if the broker is unreachable (no client) or unacknowledged bytes exceed
   ``producer_buffer_bytes``, the whole record is dropped and counted. kafka-python 3 has no
   buffer_memory bound of its own, and its ``send`` can block up to ``max_block_ms``; either way
   only this thread waits, and the tap drops (counted) when the staging ring fills meanwhile;
5. a producer that cannot bootstrap is retried every ``reconnect_backoff_s``: capture resumes by
   itself when the broker returns.
``close`` drains the queue, sends what completed, and flushes within the time limit.
With ``ACK_LOG_ENV`` set, every chunk the broker acknowledged is also appended to a file there
(``AckLog``): what an audit (or the chaos test) compares with the dataset's rows.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any, Callable

from tide import metrics
from tide.capture.assembler import GapError, PendingRequest, StagedStep, build_record
from tide.config import CaptureConfig, KafkaConfig
from tide.records import RecordError, encode, split

log = logging.getLogger(__name__)

_DISCARDED_MEMORY = 4096  # abandoned request ids remembered to ignore their straggling steps
# a folder: each worker appends one JSON line per acknowledged chunk to acks-<pid>.jsonl there
ACK_LOG_ENV = "TIDE_CAPTURE_ACK_LOG_DIR"


def kafka_client(config: CaptureConfig, kafka: KafkaConfig) -> Any:
    """A kafka-python producer configured for capture (imported lazily: tests may swap it)."""
    from kafka import KafkaProducer

    return KafkaProducer(
        bootstrap_servers=kafka.bootstrap_servers.split(","), acks="all",
        enable_idempotence=True, compression_type=config.compression or None,
        linger_ms=config.linger_ms, batch_size=config.batch_bytes,
        max_request_size=max(config.max_message_bytes + 64 * 1024, config.batch_bytes),
        delivery_timeout_ms=int(config.delivery_timeout_s * 1000),
        request_timeout_ms=int(config.request_timeout_s * 1000),
        max_block_ms=int(config.connect_timeout_s * 1000),
        bootstrap_timeout_ms=int(config.connect_timeout_s * 1000),
        reconnect_backoff_max_ms=1000, client_id="tide-capture")


class AckLog:
    """Acknowledged chunks, one JSON line each, written as the ack arrives (a line that reached
    the file survives this process being killed): request id, chunk, positions, partition, offset."""

    def __init__(self, folder: str) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(folder) / f"acks-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> "AckLog | None":
        folder = os.environ.get(ACK_LOG_ENV)
        return cls(folder) if folder else None

    def write(self, chunk: Any, metadata: Any) -> None:
        line = json.dumps({"request_id": chunk.request_id, "chunk_index": chunk.chunk_index,
                           "chunk_count": chunk.chunk_count, "position_start": chunk.position_start,
                           "num_tokens": chunk.num_tokens, "partition": metadata.partition,
                           "offset": metadata.offset})
        with self._lock:  # acks arrive on kafka-python's I/O thread, late ones after close
            if not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


class _Delivery:
    """Acks of one record's chunks; the record counts as produced when all of them arrive."""

    __slots__ = ("owner", "remaining", "failed", "tokens")

    def __init__(self, owner: "CaptureProducer", chunks: int, tokens: int) -> None:
        self.owner, self.remaining, self.failed, self.tokens = owner, chunks, False, tokens

    # called from kafka-python's IO thread (acks) and the producer thread (send errors)
    def ok(self, size: int) -> None:
        self.owner._settle(size, ok=True)
        with self.owner._ack_lock:
            self.remaining -= 1
            produced = self.remaining == 0 and not self.failed
        if produced:
            metrics.CAPTURE_PRODUCED_RECORDS.inc()
            metrics.CAPTURE_PRODUCED_TOKENS.inc(self.tokens)

    def error(self, size: int, exc: BaseException) -> None:
        self.owner._settle(size, ok=False)
        metrics.CAPTURE_PRODUCE_ERRORS.labels(type(exc).__name__).inc()
        with self.owner._ack_lock:
            first_failure, self.failed = not self.failed, True
        if first_failure:
            metrics.CAPTURE_DROPPED_RECORDS.labels("delivery_failed").inc()


class CaptureProducer:
    """Sends completed requests to ``kafka.topic`` (see the module's steps)."""

    def __init__(self, config: CaptureConfig, kafka: KafkaConfig, source: "queue.Queue[StagedStep]",
                 aborted: "deque[str]",
                 client_factory: Callable[[CaptureConfig, KafkaConfig], Any] = kafka_client) -> None:
        self.config = config
        self.kafka = kafka
        self._source = source
        self._aborted = aborted
        self._client_factory = client_factory
        self._client: Any = None
        self._next_connect_s = 0.0
        self._pending: dict[str, PendingRequest] = {}
        self._discarded: OrderedDict[str, None] = OrderedDict()
        self._unacked_bytes = 0
        self._ack_lock = threading.Lock()
        self._ack_log = AckLog.from_env()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tide-capture-producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def unacked_bytes(self) -> int:
        return self._unacked_bytes

    # --- thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        last_housekeeping = 0.0
        while not self._stop.is_set():
            try:
                step = self._source.get(timeout=0.1)
            except queue.Empty:
                step = None
            try:
                if step is not None:
                    self._handle(step)
                now = time.monotonic()
                if now - last_housekeeping > 0.5:
                    last_housekeeping = now
                    self._housekeeping(now)
            except Exception:  # the thread must survive anything a step or the client does
                log.exception("capture producer step failed")
                metrics.CAPTURE_PRODUCE_ERRORS.labels("internal").inc()

    def _handle(self, step: StagedStep) -> None:
        self._drain_aborted()
        rid = step.meta.request_id
        if rid in self._discarded:
            return
        pending = self._pending.get(rid)
        if pending is None:
            if len(self._pending) >= self.config.max_open_requests:
                self._abandon(next(iter(self._pending)), "too_many_open")
            pending = self._pending[rid] = PendingRequest(step.meta)
        try:
            pending.add(step, self.config.max_tokens_per_request, time.monotonic())
        except GapError as exc:
            log.debug("%s", exc)
            self._abandon(rid, "gap")
            return
        if pending.complete:
            del self._pending[rid]
            self._remember_discarded(rid)  # ignore steps after truncation at max_tokens
            if pending.tokens:
                self._send(pending)

    def _housekeeping(self, now: float) -> None:
        self._drain_aborted()
        idle_before = now - self.config.request_idle_timeout_s
        for rid in [r for r, p in self._pending.items() if p.last_step_at_s < idle_before]:
            self._abandon(rid, "idle_timeout")
        metrics.CAPTURE_QUEUE_DEPTH.set(self._source.qsize())
        metrics.CAPTURE_OPEN_REQUESTS.set(len(self._pending))
        metrics.CAPTURE_UNACKED_BYTES.set(self._unacked_bytes)
        if self._client is None:
            self._connect()

    def _drain_aborted(self) -> None:
        while self._aborted:
            rid = self._aborted.popleft()
            self._remember_discarded(rid)
            if self._pending.pop(rid, None) is not None:
                metrics.CAPTURE_DROPPED_RECORDS.labels("queue_full").inc()

    def _abandon(self, rid: str, reason: str) -> None:
        self._pending.pop(rid, None)
        self._remember_discarded(rid)
        metrics.CAPTURE_DROPPED_RECORDS.labels(reason).inc()

    def _remember_discarded(self, rid: str) -> None:
        self._discarded[rid] = None
        if len(self._discarded) > _DISCARDED_MEMORY:
            self._discarded.popitem(last=False)

    # --- Kafka ----------------------------------------------------------------------------------
    def _connect(self) -> bool:
        now = time.monotonic()
        if now < self._next_connect_s:
            return False
        self._next_connect_s = now + self.config.reconnect_backoff_s
        try:
            self._client = self._client_factory(self.config, self.kafka)
        except Exception as exc:
            log.warning("capture: cannot reach broker %s (%s); retrying in %.0f s",
                        self.kafka.bootstrap_servers, exc, self.config.reconnect_backoff_s)
            metrics.CAPTURE_BROKER_UP.set(0)
            return False
        metrics.CAPTURE_BROKER_UP.set(1)
        return True

    def _send(self, pending: PendingRequest) -> None:
        if self._client is None and not self._connect():
            metrics.CAPTURE_DROPPED_RECORDS.labels("broker_unavailable").inc()
            return
        try:
            record = build_record(pending, self.config.hidden_dtype,
                                  self.config.max_tokens_per_request)
            chunks = split(record, self.config.max_message_bytes)
            values = [encode(chunk) for chunk in chunks]
        except (RecordError, ValueError, RuntimeError) as exc:
            log.warning("capture: cannot encode request %s: %s", pending.meta.request_id, exc)
            metrics.CAPTURE_DROPPED_RECORDS.labels("encode_error").inc()
            return
        size = sum(len(v) for v in values)
        if self._unacked_bytes + size > self.config.producer_buffer_bytes:
            metrics.CAPTURE_DROPPED_RECORDS.labels("buffer_full").inc()
            return
        key = pending.meta.request_id.encode()
        delivery = _Delivery(self, len(values), record.num_tokens)
        for chunk, value in zip(chunks, values):
            with self._ack_lock:
                self._unacked_bytes += len(value)
            try:
                future = self._client.send(self.kafka.topic, key=key, value=value)
            except Exception as exc:  # KafkaTimeoutError: no metadata within max_block_ms
                delivery.error(len(value), exc)
                if type(exc).__name__ != "KafkaTimeoutError":
                    self._reset_client()  # e.g. a producer left in a fatal state
                break  # the record is lost anyway; later chunks would only be orphans
            n = len(value)
            future.add_callback(lambda _m, n=n: delivery.ok(n))
            if self._ack_log is not None:
                future.add_callback(lambda m, c=chunk: self._ack_log.write(c, m))
            future.add_errback(lambda exc, n=n: delivery.error(n, exc))

    def _reset_client(self) -> None:
        client, self._client = self._client, None
        metrics.CAPTURE_BROKER_UP.set(0)
        try:
            client.close(timeout=0)
        except Exception:
            log.debug("closing a failed Kafka producer raised", exc_info=True)

    def _settle(self, size: int, ok: bool) -> None:
        with self._ack_lock:
            self._unacked_bytes -= size
        if ok:
            metrics.CAPTURE_PRODUCED_MESSAGES.inc()
            metrics.CAPTURE_PRODUCED_BYTES.inc(size)

    # --- shutdown -------------------------------------------------------------------------------
    def close(self, timeout_s: float) -> None:
        """Stop the loop, send what the queue still completes, flush within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("capture producer thread did not stop within %.1f s", timeout_s)
            return
        while time.monotonic() < deadline:
            try:
                self._handle(self._source.get_nowait())
            except queue.Empty:
                break
            except Exception:
                log.exception("capture producer step failed during close")
        for rid in list(self._pending):
            self._abandon(rid, "shutdown")
        if self._client is not None:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                self._client.flush(timeout=remaining)
            except Exception as exc:  # KafkaTimeoutError: undelivered records are counted on close
                log.warning("capture: flush incomplete after %.1f s: %s", timeout_s, exc)
            try:
                self._client.close(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                log.exception("capture: closing the Kafka producer failed")
            self._client = None
        metrics.CAPTURE_UNACKED_BYTES.set(self._unacked_bytes)
        metrics.CAPTURE_OPEN_REQUESTS.set(0)
        metrics.CAPTURE_QUEUE_DEPTH.set(self._source.qsize())
        if self._ack_log is not None:
            self._ack_log.close()
