"""The capture tap: the engine's ``CaptureSink``; stages rows in shared memory and nothing else.

``offer`` runs on the engine's decode loop once per step, for all of the step's captures. It:
1. looks up (or decides once, by hashing the request id) whether each request is sampled, and
   skips positions past ``max_tokens_per_request`` (the worker completes the record at the limit);
2. reserves one block of the staging ring (``tide.capture.ring``) for the step and copies each
   request's rows into it: contiguous CPU rows of the stored dtype, float32 (bf16 storage) or
   int64 ids with one memmove of their bytes (the worker casts: no torch call on the hot path);
   anything else (GPU tensors, fp8 storage of float32 rows) cast by torch into the ring;
3. writes one small frame (block position, request ids, positions; a request's metadata with
   its first step) to the worker's pipe: one atomic non-blocking write;
4. when the ring or the pipe is full, or the worker is down, drops the step's captures, counts
   them, and marks their requests broken so later steps are skipped and the worker abandons what
   it holds of them. It never blocks and no exception escapes.
The worker process (``tide.capture.worker``) assembles, checksums, compresses and produces to
Kafka; a reader thread here applies the counters it reports to this process's metrics and, if the
worker dies, counts it and starts a new one after ``reconnect_backoff_s``. A worker is handed
to ``offer`` only once it has sent its first report (it is reading frames): while it starts
(seconds on a loaded machine), frames would only pile up in the pipe until it overflowed.
``close`` asks the worker to drain and flush within a time limit.
"""
from __future__ import annotations

import ctypes
import logging
import pickle
import subprocess
import threading
import time

import numpy as np
import torch

from tide import metrics
from tide.capture.assembler import StagedStep
from tide.capture.ring import (
    CLOSE,
    CLOSED,
    FLOAT32,
    INT64,
    PIPE_BUF,
    STATS,
    STEP,
    STORED,
    StagingRing,
    align,
    pack_frame,
    write_frame,
)
from tide.capture.sampling import SamplingPolicy
from tide.capture.worker import WorkerHandle
from tide.config import CaptureConfig, KafkaConfig
from tide.contracts import HIDDEN_ITEMSIZE, StepCapture

log = logging.getLogger(__name__)

# per-request tap state: [sampled, positions offered, broken, drafter version sent with the
# metadata or since (None: metadata not sent yet)]
_SAMPLED, _TOKENS, _BROKEN, _META_SENT = 0, 1, 2, 3
_MAX_ABORTED = 4096  # broken request ids waiting for frames that reach the worker
_ABORTED_PER_FRAME = 8  # so a frame stays under PIPE_BUF
_TOKEN_SOURCES = {torch.int64: (INT64, 8), torch.int32: (STORED, 4)}
_memmove = ctypes.memmove
# python start-up and imports of the worker; generous because the machine may be loaded
_WORKER_START_TIMEOUT_S = 30.0


def stage(capture: StepCapture, hidden_dtype: str) -> StagedStep:
    """What the worker rebuilds from a capture's staged rows (the same cast the ring copy does)."""
    dtype, bits = getattr(torch, hidden_dtype), torch.int16 if HIDDEN_ITEMSIZE[hidden_dtype] == 2 else torch.uint8

    def raw(t: torch.Tensor) -> np.ndarray:
        rows = t.detach().to(device="cpu", dtype=dtype).contiguous().view(bits).numpy().view(np.uint8)
        return rows.reshape(int(t.shape[0]), int(t.shape[-1]) * HIDDEN_ITEMSIZE[hidden_dtype]).copy()
    return StagedStep(capture.meta, capture.start_position,
                      capture.token_ids.detach().cpu().numpy().astype(np.int32), raw(capture.aux_hidden),
                      raw(capture.final_hidden), capture.is_prompt, capture.finished)


class CaptureTap:
    """Bounded, non-blocking capture sink with sampling; owns the capture worker process."""

    def __init__(self, config: CaptureConfig, kafka: KafkaConfig) -> None:
        self.config, self.kafka = config, kafka
        self.policy = SamplingPolicy(config.sample_fraction, dict(config.workload_fractions))
        if config.hidden_dtype not in HIDDEN_ITEMSIZE:
            raise ValueError(f"hidden_dtype {config.hidden_dtype!r} not in {sorted(HIDDEN_ITEMSIZE)}")
        self._dtype, self._item = getattr(torch, config.hidden_dtype), HIDDEN_ITEMSIZE[config.hidden_dtype]
        self._requests: dict[str, list] = {}
        # the engine may never report some requests finished (crash, cancel): bound the state
        self._max_tracked = 4 * config.max_open_requests
        self._aborted: list[str] = []
        self._sent_steps = 0
        self._closed = False
        self._lock = threading.Lock()  # offer vs. a worker restart (uncontended on the hot path)
        self._ring = StagingRing.create(config.staging_bytes)
        self._bytes = torch.frombuffer(self._ring.data, dtype=torch.uint8)
        self._address = self._ring.data.ctypes.data
        # source dtypes staged as raw bytes, which the worker turns into the stored dtype
        self._sources = {self._dtype: (STORED, self._item)}
        if self._dtype is torch.bfloat16:
            self._sources[torch.float32] = (FLOAT32, 4)
        self._worker: WorkerHandle | None = None
        self._worker = self._start_worker()
        self._reader = threading.Thread(target=self._supervise, name="tide-capture-reports", daemon=True)
        self._reader.start()

    @property
    def queue_depth(self) -> int:
        worker = self._worker
        return self._sent_steps - (worker.consumed_steps if worker is not None else self._sent_steps)

    @property
    def unacked_bytes(self) -> int:
        worker = self._worker
        return worker.unacked_bytes if worker is not None else 0

    @property
    def worker_pid(self) -> int | None:
        worker = self._worker
        return worker.process.pid if worker is not None else None

    # --- the decode thread ----------------------------------------------------------------------
    def offer(self, captures: list[StepCapture]) -> None:
        """Stage this step's captures for the worker; never blocks, never raises."""
        if self._closed:
            return
        try:
            with self._lock:
                self._offer(captures)
        except Exception:  # inference must not fail because of capture
            log.exception("capture tap: offer failed")
            metrics.CAPTURE_DROPPED_STEPS.labels("tap_error").inc()

    def _offer(self, captures: list[StepCapture]) -> None:
        entries, staged, size = [], [], 0
        for capture in captures:
            state = self._state(capture)
            if not state[_SAMPLED] or state[_BROKEN] or state[_TOKENS] >= self.config.max_tokens_per_request:
                continue
            n = int(capture.token_ids.shape[0])
            state[_TOKENS] += n
            plan = (self._plan(capture.token_ids, n, _TOKEN_SOURCES, 4),
                    self._plan(capture.aux_hidden, n, self._sources, self._item),
                    self._plan(capture.final_hidden, n, self._sources, self._item))
            sent, version = state[_META_SENT], capture.meta.drafter_version
            meta = None if sent is not None else vars(capture.meta)
            # a swap while the request runs: its later positions belong to the new drafter version
            changed = version if sent is not None and sent != version else None
            entries.append((capture.meta.request_id, meta, changed, capture.start_position, n, capture.is_prompt,
                            capture.finished, size) + tuple(p[:2] for p in plan))
            staged.append((capture, size, n, state, plan))
            size += sum(align(n * p[1]) for p in plan)
        if not entries:
            return
        worker = self._worker
        if worker is None:
            return self._drop(staged, "worker_down")
        start = self._ring.reserve(size)
        if start is None:
            return self._drop(staged, "queue_full")
        base = self._ring.offset(start)
        for capture, rel, n, _, plan in staged:
            if n:
                self._copy_rows(capture, base + rel, n, plan)
        aborted = self._aborted[:_ABORTED_PER_FRAME]
        frame = pack_frame((STEP, start, size, entries, aborted))
        if len(frame) > PIPE_BUF:
            return self._drop(staged, "frame_too_large")
        try:
            sent = write_frame(worker.frames_w, frame)
        except OSError:  # BrokenPipeError: the worker died; the supervisor restarts it
            return self._drop(staged, "worker_down")
        if not sent:
            return self._drop(staged, "queue_full")
        self._ring.commit(start, size)
        del self._aborted[:len(aborted)]
        for capture, _, _, state, _ in staged:
            state[_META_SENT] = capture.meta.drafter_version
        self._sent_steps += 1
        metrics.CAPTURE_STEPS.inc(len(staged))

    def _state(self, capture: StepCapture) -> list:
        rid = capture.meta.request_id
        state = self._requests.get(rid)
        if state is None:
            sampled = self.policy.admits(rid, capture.meta.workload)
            metrics.CAPTURE_REQUESTS.labels("sampled" if sampled else "skipped").inc()
            state = [sampled, 0, False, None]
            if len(self._requests) >= self._max_tracked:
                self._requests.pop(next(iter(self._requests)))
            self._requests[rid] = state
        if capture.finished:
            self._requests.pop(rid, None)
        return state

    def _plan(self, t: torch.Tensor, n: int, raw: dict, cast_item: int) -> tuple[str, int, bool]:
        """How one tensor is staged: (source kind for the worker, bytes per row, copied with memmove).
        A CPU tensor of ``n`` contiguous rows whose dtype the worker can turn into the stored one is
        copied as raw bytes (one memmove, no torch dispatch: a cold torch copy costs several times
        as much); anything else is cast by torch into the ring and arrives as stored."""
        shape = t.shape
        width = shape[-1] if len(shape) > 1 else 1
        kind = raw.get(t.dtype)
        if kind is not None and t.is_cpu and len(shape) <= 2 and (n == 0 or t.is_contiguous()):
            return kind[0], width * kind[1], True
        return STORED, width * cast_item, False

    def _copy_rows(self, capture: StepCapture, at: int, n: int, plan: tuple) -> None:
        tokens, aux, final = plan
        at = self._copy(capture.token_ids, at, n, tokens, torch.int32)
        at = self._copy(capture.aux_hidden, at, n, aux, self._dtype)
        self._copy(capture.final_hidden, at, n, final, self._dtype)

    def _copy(self, t: torch.Tensor, at: int, n: int, plan: tuple, stored: torch.dtype) -> int:
        _, width, raw = plan
        if raw:
            _memmove(self._address + at, t.data_ptr(), n * width)
        else:
            self._bytes[at:at + n * width].view(stored).view(n, -1).copy_(t.reshape(n, -1))
        return at + align(n * width)

    def _drop(self, staged: list, reason: str) -> None:
        for capture, _, _, state, _ in staged:
            self._break(capture.meta.request_id, state, worker_alive=reason != "worker_down")
        metrics.CAPTURE_DROPPED_STEPS.labels(reason).inc(len(staged))

    def _break(self, rid: str, state: list, worker_alive: bool) -> None:
        """Skip the request's later steps; what the worker held of it is dropped, counted once."""
        if state[_BROKEN]:
            return
        state[_BROKEN] = True
        if state[_META_SENT] is None:
            return
        if worker_alive:  # tell it to abandon the request (it counts the record as queue_full)
            self._aborted.append(rid)
            del self._aborted[:-_MAX_ABORTED]
        else:
            metrics.CAPTURE_DROPPED_RECORDS.labels("worker_died").inc()

    # --- the supervisor thread ------------------------------------------------------------------
    def _supervise(self) -> None:
        while True:
            worker = self._worker
            if worker is not None:
                self._read_reports(worker)
            if self._closed:
                return
            self._restart(worker)

    def _read_reports(self, worker: WorkerHandle) -> None:
        while True:
            try:
                message = pickle.loads(worker.reports.recv_bytes())
            except (EOFError, OSError):
                return
            if message[0] == STATS:
                self._apply(worker, message[1])
            elif message[0] == CLOSED:
                worker.closed.set()
                return

    def _apply(self, worker: WorkerHandle, stats: dict) -> None:
        worker.consumed_steps, worker.unacked_bytes = stats["consumed_steps"], stats["unacked_bytes"]
        for index, is_counter, labels, value in stats["metrics"]:
            group = metrics.CAPTURE_WORKER_COUNTERS if is_counter else metrics.CAPTURE_WORKER_GAUGES
            metric = group[index].labels(**labels) if labels else group[index]
            if not is_counter:
                metric.set(value)
                continue
            key = (index, tuple(sorted(labels.items())))
            delta, worker.last[key] = value - worker.last.get(key, 0.0), value
            if delta > 0:
                metric.inc(delta)
        metrics.CAPTURE_QUEUE_DEPTH.set(self.queue_depth)

    def _restart(self, dead: WorkerHandle | None) -> None:
        """The worker exited unasked: count what it held, then start a new one after a backoff."""
        with self._lock:
            if dead is not None:
                for rid, state in self._requests.items():  # a new worker must not get later steps only
                    self._break(rid, state, worker_alive=False)
                log.error("capture worker exited (code %s); its open requests are lost; restarting in %.1f s",
                          dead.process.poll(), self.config.reconnect_backoff_s)
                metrics.CAPTURE_WORKER_RESTARTS.inc()
                dead.close_pipes()
                self._worker = None
        deadline = time.monotonic() + self.config.reconnect_backoff_s
        while not self._closed and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._closed:
            return
        with self._lock:  # until the new worker reads frames, offers see none and drop (worker_down)
            self._ring.reset()  # nobody reads the ring now
            self._sent_steps = 0
        worker = self._start_worker()
        with self._lock:
            if not self._closed:
                self._worker = worker
                return
        if worker is not None:  # close() came meanwhile and did not see it: EOF makes it flush and exit
            worker.close_pipes()

    def _start_worker(self) -> WorkerHandle | None:
        """A new worker, returned once it reads frames (or after a time limit: then late)."""
        try:
            worker = WorkerHandle(self.config, self.kafka, self._ring)
        except OSError:
            log.exception("capture: cannot start the capture worker")
            return None
        message = worker.first_report(_WORKER_START_TIMEOUT_S)
        if message is None:
            log.error("capture worker sent no report within %.0f s", _WORKER_START_TIMEOUT_S)
        elif message[0] == STATS:
            self._apply(worker, message[1])
        return worker

    # --- shutdown -------------------------------------------------------------------------------
    def close(self, timeout_s: float | None = None) -> None:
        """Stop sampling new requests, then let the worker drain and flush within the limit."""
        timeout_s = self.config.flush_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._closed = True
            worker = self._worker
        if worker is not None:
            frame = pack_frame((CLOSE, max(0.0, timeout_s - 0.5)))
            while time.monotonic() < deadline:
                try:
                    if write_frame(worker.frames_w, frame):
                        break
                except OSError:
                    break
                time.sleep(0.01)
            worker.closed.wait(max(0.0, deadline - time.monotonic()) + 0.5)
            try:
                worker.process.wait(timeout=max(0.1, deadline - time.monotonic()) + 1.0)
            except subprocess.TimeoutExpired:
                log.warning("capture worker did not exit within %.1f s; killing it", timeout_s)
                worker.process.kill()
                worker.process.wait(timeout=5)
            worker.close_pipes()
        self._reader.join(timeout=2.0)
        self._bytes = None
        self._ring.close()
        metrics.CAPTURE_QUEUE_DEPTH.set(0)
