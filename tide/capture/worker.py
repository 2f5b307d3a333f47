"""The capture worker process: staged rows -> records -> Kafka, off the engine's process.

``python -m tide.capture.worker`` is started by the engine's ``CaptureTap`` (never by hand). It
imports numpy, kafka-python and the record format, never torch, so its serialisation,
compression and Kafka I/O cost the engine's decode thread no GIL time. Loop steps:
1. read a frame from the tap's pipe; when there is none, sleep ``FRAMES_POLL_S`` (never block on
   the pipe: see there);
2. a step frame: copy each entry's rows out of the staging ring into the request's arrays, then
   advance the ring's tail (the tap may reuse those bytes), hand the staged steps to the producer
   thread (``CaptureProducer``: assembly, CRC, chunking, compression, sends, broker outages);
   requests the tap marked broken are abandoned;
3. every ``stats_interval_s``: send the capture counters and gauges to the tap, which serves them
   from the engine's /metrics;
4. a close frame, or the tap's end of the pipe closing: close the producer (drain, flush within
   the frame's time limit), send the last stats and exit.
``WorkerHandle`` is the tap's side: it starts this process with the two pipes and the ring's name.
"""
from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

import tide
from tide import metrics
from tide.capture.assembler import StagedStep
from tide.capture.producer import CaptureProducer
from tide.capture.ring import CLOSE, CLOSED, INT64, STATS, STEP, StagingRing, align, unstage
from tide.config import CaptureConfig, KafkaConfig
from tide.contracts import CaptureMeta

log = logging.getLogger("tide.capture.worker")

STATS_INTERVAL_S = 0.25
# the worker sleeps between looks at an empty frames pipe instead of blocking on it: a reader
# blocked on the pipe is woken by every frame and, on a busy machine, often preempts the engine's
# decode thread inside offer() (offer p99 several times higher, maxima of ms); the frames wait in
# the pipe (1 MiB) and the ring meanwhile
FRAMES_POLL_S = 0.005
# frames are ~200 B: the default 64 KiB pipe holds only a few hundred steps, so a worker that is
# briefly descheduled makes the tap drop; 1 MiB (Linux's default pipe-max-size) holds thousands
FRAMES_PIPE_BYTES = 1 << 20
_MAX_METAS = 8192  # metas of requests whose last step has not come yet


def metric_snapshot() -> list[tuple[int, bool, dict, float]]:
    """(index, is counter, labels, value) of every reported capture metric's samples."""
    out = []
    for kind, group in ((True, metrics.CAPTURE_WORKER_COUNTERS), (False, metrics.CAPTURE_WORKER_GAUGES)):
        for index, metric in enumerate(group):
            for family in metric.collect():
                for s in family.samples:
                    if (s.name.endswith("_total") if kind else s.name == family.name):
                        out.append((index, kind, dict(s.labels), float(s.value)))
    return out


class Worker:
    def __init__(self, config: CaptureConfig, kafka: KafkaConfig, ring: StagingRing,
                 frames: Connection, reports: Connection) -> None:
        self.config, self.ring, self.frames, self.reports = config, ring, frames, reports
        self.source: queue.Queue[StagedStep] = queue.Queue(maxsize=max(1, config.queue_max_items))
        self.aborted: deque[str] = deque()
        self.producer = CaptureProducer(config, kafka, self.source, self.aborted)
        self.metas: OrderedDict[str, CaptureMeta] = OrderedDict()
        self.consumed_steps = 0

    def run(self) -> None:
        self.producer.start()
        next_stats = 0.0
        close_timeout_s = self.config.flush_timeout_s
        while True:
            try:
                message = pickle.loads(self.frames.recv_bytes()) if self.frames.poll(0) else None
                if message is None:
                    time.sleep(FRAMES_POLL_S)
            except (EOFError, OSError):  # the engine went away: flush what we have and leave
                break
            if message is not None and message[0] == CLOSE:
                close_timeout_s = message[1]
                break
            if message is not None and message[0] == STEP:
                self.take(*message[1:])
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + STATS_INTERVAL_S
                self.report()
        self.producer.close(close_timeout_s)
        self.report()
        self.reports.send_bytes(pickle.dumps((CLOSED,)))

    def take(self, start: int, size: int, entries: list, aborted: list[str]) -> None:
        self.aborted.extend(aborted)
        base = self.ring.offset(start)
        steps = [self.copy_out(base, *entry) for entry in entries]
        self.ring.set_tail(start + align(size))
        for step in steps:
            if step is not None:
                self.source.put(step)  # blocks while the producer is behind: the ring fills instead
        self.consumed_steps += 1

    def copy_out(self, base: int, rid: str, meta: dict | None, version: str | None, position: int, n: int,
                 is_prompt: bool, finished: bool, rel: int, *layout: tuple[str, int]) -> StagedStep | None:
        """One entry's rows out of the ring; ``layout``: (kind, bytes per row) of the token ids,
        aux and final blocks, which follow one another at aligned offsets. ``version``: the drafter
        version from this step on, when a swap changed it while the request ran."""
        if meta is not None:
            self.metas[rid] = CaptureMeta(**meta)
            if len(self.metas) > _MAX_METAS:
                self.metas.popitem(last=False)
        if version is not None and rid in self.metas:
            self.metas[rid] = dataclasses.replace(self.metas[rid], drafter_version=version)
        request = self.metas.pop(rid, None) if finished else self.metas.get(rid)
        if request is None:  # its first step was dropped, or it was evicted: nothing to attach to
            return None
        data, at = self.ring.data, base + rel
        (token_kind, token_w), hidden = layout[0], []
        tokens = data[at:at + n * token_w]
        tokens = tokens.view(np.int64).astype(np.int32) if token_kind == INT64 else tokens.view(np.int32).copy()
        at += align(n * token_w)
        for kind, width in layout[1:]:
            hidden.append(unstage(data[at:at + n * width], n, width, kind))
            at += align(n * width)
        return StagedStep(request, position, tokens, *hidden, is_prompt, finished)

    def report(self) -> None:
        stats = {"metrics": metric_snapshot(), "consumed_steps": self.consumed_steps,
                 "unacked_bytes": self.producer.unacked_bytes}
        self.reports.send_bytes(pickle.dumps((STATS, stats)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tide.capture.worker", description=__doc__.splitlines()[0])
    ap.add_argument("--frames-fd", type=int, required=True)
    ap.add_argument("--reports-fd", type=int, required=True)
    ap.add_argument("--shm", required=True)
    ap.add_argument("--config", required=True, help="JSON: {capture: {...}, kafka: {...}}")
    return ap.parse_args(argv)


def config_json(capture: CaptureConfig, kafka: KafkaConfig) -> str:
    return json.dumps({"capture": capture.model_dump(), "kafka": kafka.model_dump()})


class WorkerHandle:
    """The tap's side of one worker process: the process and the two pipes to it."""

    def __init__(self, config: CaptureConfig, kafka: KafkaConfig, ring: StagingRing) -> None:
        frames_r, self.frames_w = os.pipe()
        reports_r, reports_w = os.pipe()
        os.set_blocking(self.frames_w, False)
        try:
            fcntl.fcntl(self.frames_w, fcntl.F_SETPIPE_SZ, FRAMES_PIPE_BYTES)
        except (OSError, AttributeError):  # not Linux, or over pipe-max-size: the default size works
            log.debug("capture: cannot enlarge the frames pipe", exc_info=True)
        root = str(Path(tide.__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tide.capture.worker", "--frames-fd", str(frames_r),
                 "--reports-fd", str(reports_w), "--shm", ring.name, "--config", config_json(config, kafka)],
                pass_fds=(frames_r, reports_w), env=env)
        finally:
            os.close(frames_r)
            os.close(reports_w)
        self.reports = Connection(reports_r, writable=False)
        self.closed = threading.Event()
        self.last: dict[tuple, float] = {}  # counter values of its previous report
        self.consumed_steps = 0
        self.unacked_bytes = 0

    def first_report(self, timeout_s: float) -> tuple | None:
        """The worker's first report, sent once it is in its loop; None if none came in time.
        Until then frames only pile up in the pipe, so offers would overflow it and drop."""
        try:
            if self.reports.poll(timeout_s):
                return pickle.loads(self.reports.recv_bytes())
        except (EOFError, OSError):
            pass
        return None

    def close_pipes(self) -> None:
        for close in (lambda: os.close(self.frames_w), self.reports.close):
            try:
                close()
            except OSError:
                pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("TIDE_CAPTURE_WORKER_LOG", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(0.001)  # the producer thread and kafka-python's I/O thread share the GIL
    cfg = json.loads(args.config)
    capture, kafka = CaptureConfig(**cfg["capture"]), KafkaConfig(**cfg["kafka"])
    ring = StagingRing.attach(args.shm)
    try:
        Worker(capture, kafka, ring, Connection(args.frames_fd, writable=False),
               Connection(args.reports_fd, readable=False)).run()
    except (BrokenPipeError, EOFError):
        log.warning("the engine's end of the capture pipe closed")
    finally:
        ring.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
