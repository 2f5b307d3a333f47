"""The capture tap: the engine's ``CaptureSink``; enqueues references and nothing else.

``offer`` runs on the engine's decode loop once per step. Per step capture it:
1. looks up (or decides once, by hashing the request id) whether the request is sampled;
2. skips steps past ``max_tokens_per_request`` (the producer completes the record at the limit);
3. ``put_nowait`` into a bounded queue; when full, drops the step, counts it, and marks the
   request broken so later steps are skipped and the producer abandons what it holds of it.
No serialisation, no network, no blocking, and no exception escapes. The background producer
(``CaptureProducer``) does the rest; ``close`` flushes within a time limit.
"""
from __future__ import annotations

import logging
import queue
from collections import deque
from typing import Any, Callable

from tide import metrics
from tide.capture.producer import CaptureProducer, kafka_client
from tide.capture.sampling import SamplingPolicy
from tide.config import CaptureConfig, KafkaConfig
from tide.engine.base import StepCapture

log = logging.getLogger(__name__)

# per-request tap state: [sampled, positions offered, broken]
_SAMPLED, _TOKENS, _BROKEN = 0, 1, 2


class CaptureTap:
    """Bounded, non-blocking capture sink with sampling; owns the producer thread."""

    def __init__(self, config: CaptureConfig, kafka: KafkaConfig,
                 client_factory: Callable[[CaptureConfig, KafkaConfig], Any] = kafka_client,
                 start: bool = True) -> None:
        self.config = config
        self.policy = SamplingPolicy(config.sample_fraction, dict(config.workload_fractions))
        self._queue: queue.Queue[StepCapture] = queue.Queue(maxsize=config.queue_max_items)
        self._aborted: deque[str] = deque()
        self._requests: dict[str, list] = {}
        # the engine may never report some requests finished (crash, cancel): bound the state
        self._max_tracked = 4 * config.max_open_requests
        self._closed = False
        self.producer = CaptureProducer(config, kafka, self._queue, self._aborted, client_factory)
        if start:
            self.producer.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def offer(self, captures: list[StepCapture]) -> None:
        """Enqueue references to this step's captures; never blocks, never raises."""
        if self._closed:
            return
        try:
            for capture in captures:
                self._offer_one(capture)
        except Exception:  # inference must not fail because of capture
            log.exception("capture tap: offer failed")
            metrics.CAPTURE_DROPPED_STEPS.labels("tap_error").inc()

    def _offer_one(self, capture: StepCapture) -> None:
        rid = capture.meta.request_id
        state = self._requests.get(rid)
        if state is None:
            sampled = self.policy.admits(rid, capture.meta.workload)
            metrics.CAPTURE_REQUESTS.labels("sampled" if sampled else "skipped").inc()
            state = [sampled, 0, False]
            if len(self._requests) >= self._max_tracked:
                self._requests.pop(next(iter(self._requests)))
            self._requests[rid] = state
        if capture.finished:
            self._requests.pop(rid, None)
        if not state[_SAMPLED] or state[_BROKEN]:
            return
        limit = self.config.max_tokens_per_request
        if state[_TOKENS] >= limit:
            return
        state[_TOKENS] += int(capture.token_ids.shape[0])
        try:
            self._queue.put_nowait(capture)
        except queue.Full:
            state[_BROKEN] = True
            self._aborted.append(rid)
            metrics.CAPTURE_DROPPED_STEPS.labels("queue_full").inc()
            return
        metrics.CAPTURE_STEPS.inc()

    def close(self, timeout_s: float | None = None) -> None:
        """Stop sampling new requests, then let the producer drain and flush within the limit."""
        self._closed = True
        self.producer.close(self.config.flush_timeout_s if timeout_s is None else timeout_s)
