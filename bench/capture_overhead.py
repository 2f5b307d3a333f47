"""Decode throughput with hidden-state capture on (100% sampling, real broker) vs off, side by side.

One engine, process-local target; for each concurrency, ``--pairs`` pairs of rounds run capture off
and on back to back (the order alternates per pair) over the same prompts, so machine-load drift
hits both modes alike. Each pair gives one ratio on/off; the table shows their mean and a 90%
Student-t interval over pairs. Capture on means the engine's tap stages every committed position
and the capture worker serialises and sends it to a real Kafka-protocol broker (tansu, on loopback).
``--ingest`` also runs the ingest service (``python -m tide.services.ingest``) consuming the topic
into Parquet in a temporary folder for the whole run: the deployment shape on one machine.
``--profile`` prints the CPU seconds each thread of this process used per mode (from
/proc/self/task/*/stat), for capture on the capture worker process's CPU seconds, and the wall
time of each ``offer`` call on the decode thread (its share of the rounds' wall time).

    python -m bench.capture_overhead [--concurrency 1,8] [--pairs 8] [--max-new-tokens 48]
                                     [--ingest] [--profile] [--json out.json]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.cpu import process_cpu_s, thread_cpu_s
from bench.report import print_table, write_json
from tide import metrics, workloads
from tide.capture.tap import CaptureTap
from tide.config import load_config
from tide.drafter.artifact import TargetSpec, load_drafter
from tide.drafter.static import static_drafter_path
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine, load_target
from tide.process import free_port
from tide.stack import _tcp_ready
from tide.train.offline import render_prompt

# two-sided 90% Student-t quantiles (0.95 one-sided) by degrees of freedom
_T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833,
        10: 1.812, 11: 1.796, 12: 1.782, 13: 1.771, 14: 1.761, 15: 1.753, 16: 1.746, 17: 1.740,
        18: 1.734, 19: 1.729, 20: 1.725, 25: 1.708, 30: 1.697}


def t_interval90(values: list[float]) -> tuple[float, float, float]:
    """Mean and 90% Student-t interval of ``values`` (nan bounds with fewer than two)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    df = len(values) - 1
    t = _T95.get(df) or _T95[max(k for k in _T95 if k <= df)]
    half = t * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


class TimedSink:
    """The tap with each ``offer``'s wall time on the decode thread recorded (``--profile``)."""

    def __init__(self, tap: CaptureTap) -> None:
        self.tap, self.offer_s = tap, []

    @property
    def worker_pid(self) -> int | None:
        return self.tap.worker_pid

    def offer(self, captures) -> None:
        t0 = time.perf_counter()
        self.tap.offer(captures)
        self.offer_s.append(time.perf_counter() - t0)


def run_round(engine, prompts, n) -> float:
    total, t0, lock = [0], time.perf_counter(), threading.Lock()

    def one(k, ids):
        req = GenerationRequest(f"c{time.monotonic_ns()}-{k}", tuple(ids), SamplingParams(max_new_tokens=n))
        got = sum(len(ev.token_ids) for ev in engine.submit(req))  # blocks until the request ends
        with lock:  # (``total[0] += sum(...)`` would read total before blocking: last writer wins)
            total[0] += got
    threads = [threading.Thread(target=one, args=(k, ids)) for k, ids in enumerate(prompts)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return total[0] / (time.perf_counter() - t0)


def _counter(metric) -> float:
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith("_total"))


def measure(engine, tap, prompts, args, profile: dict) -> dict:
    """``args.pairs`` alternating off/on pairs at this concurrency; per-pair ratios."""
    on, off = [], []
    run_round(engine, prompts[:2], 8)  # warm-up
    for p in range(args.pairs):
        for mode in (("off", "on") if p % 2 == 0 else ("on", "off")):
            engine.set_capture_sink(tap if mode == "on" else None)
            cpu0, w0 = thread_cpu_s(), process_cpu_s(tap.worker_pid) if mode == "on" else 0.0
            t0 = time.perf_counter()
            (on if mode == "on" else off).append(run_round(engine, prompts, args.max_new_tokens))
            profile[(mode, "<round wall time>")] = profile.get((mode, "<round wall time>"), 0.0) + (
                time.perf_counter() - t0)
            cpu1 = thread_cpu_s()
            for name, value in cpu1.items():
                key = (mode, name)
                profile[key] = profile.get(key, 0.0) + value - cpu0.get(name, 0.0)
            if mode == "on":
                profile[("on", "<capture worker process>")] = profile.get(
                    ("on", "<capture worker process>"), 0.0) + process_cpu_s(tap.worker_pid) - w0
    engine.set_capture_sink(None)
    ratios = [a / b for a, b in zip(on, off)]
    mean, lo, hi = t_interval90(ratios)
    return {"capture_on_tok_s": on, "capture_off_tok_s": off, "pair_ratios": ratios,
            "ratio_mean": mean, "ratio_90ci": [lo, hi]}


def start_ingest(port: int, data_dir: str) -> subprocess.Popen:
    env = {**os.environ, "TIDE_INGEST__METRICS_PORT": "0"}
    return subprocess.Popen([sys.executable, "-m", "tide.services.ingest", "--bootstrap-servers",
                             f"127.0.0.1:{port}", "--data-dir", data_dir, "--log-level", "WARNING"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8", help="comma-separated concurrent requests per round")
    ap.add_argument("--pairs", type=int, default=8, help="alternating off/on pairs per concurrency")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--ingest", action="store_true", help="run the ingest service at the same time")
    ap.add_argument("--profile", action="store_true", help="CPU seconds per thread and mode")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    port = free_port()
    state = Path(tempfile.mkdtemp(prefix="tide-bench-broker-"))
    broker = subprocess.Popen([sys.executable, "-m", "tide.broker", "run", "memory", "--port", str(port),
                               "--state-dir", str(state)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    ingest = None
    try:
        deadline = time.monotonic() + 60
        while not _tcp_ready(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        if args.ingest:
            ingest = start_ingest(port, tempfile.mkdtemp(prefix="tide-bench-dataset-"))
        cfg = load_config(overrides={"capture": {"enabled": True, "sample_fraction": 1.0},
                                     "kafka": {"bootstrap_servers": f"127.0.0.1:{port}"}})
        target, tok, _ = load_target(cfg)
        drafter = load_drafter(static_drafter_path(cfg), TargetSpec(target.shape.hidden_size,
                                                                    target.shape.vocab_size, target.aux_layer_ids))
        prompts = [render_prompt(tok, p.chat_messages(), 256)
                   for p in workloads.load_workload("chat", "heldout", max(levels), seed=2)]
        engine = ReferenceEngine(target, tok, drafter, "static", target_model_id=cfg.model.model_id,
                                 draft_len=cfg.spec.draft_len, max_batch_size=max(levels),
                                 max_seq_len=cfg.model.max_seq_len)
        tap = CaptureTap(cfg.capture, cfg.kafka)
        if args.profile:
            tap = TimedSink(tap)
        results, profile = {}, {}
        try:
            for c in levels:
                results[c] = measure(engine, tap, prompts[:c], args, profile)
        finally:
            engine.close()
            (tap.tap if args.profile else tap).close(30)
        dropped, produced = _counter(metrics.CAPTURE_DROPPED_STEPS), _counter(metrics.CAPTURE_PRODUCED_RECORDS)
        rows = [("metric", "value"), ("pairs per concurrency (alternating)", args.pairs),
                ("ingest service running", bool(args.ingest))]
        for c, r in results.items():
            rows += [(f"c={c} capture off tok/s", " ".join(f"{x:.1f}" for x in r["capture_off_tok_s"])),
                     (f"c={c} capture on  tok/s", " ".join(f"{x:.1f}" for x in r["capture_on_tok_s"])),
                     (f"c={c} ratio on/off mean [90% t-interval]",
                      f"{r['ratio_mean']:.3f} [{r['ratio_90ci'][0]:.3f}, {r['ratio_90ci'][1]:.3f}]")]
        rows += [("records produced", produced), ("steps dropped", dropped)]
        print_table("capture overhead (engine decode throughput)", rows)
        if args.profile:
            names = sorted({n for _, n in profile})
            offers = sorted(tap.offer_s)
            if offers:
                q = statistics.quantiles(offers, n=100, method="inclusive") if len(offers) > 1 else [offers[0]] * 99
                print_table("offer() on the decode thread (all concurrencies)", [("metric", "value"),
                    ("calls", len(offers)), ("total s", f"{sum(offers):.3f}"),
                    ("share of capture-on round wall time", f"{sum(offers) / profile[('on', '<round wall time>')]:.4f}"),
                    ("median / p90 / p99 / max us", f"{statistics.median(offers) * 1e6:.0f} / {q[89] * 1e6:.0f} / "
                     f"{q[98] * 1e6:.0f} / {offers[-1] * 1e6:.0f}")])
            print_table("CPU seconds per thread, summed over all rounds of a mode", [("thread", "off", "on")] + [
                (n, f"{profile.get(('off', n), 0.0):.2f}", f"{profile.get(('on', n), 0.0):.2f}") for n in names])
        write_json(args.json, {"results": {str(c): r for c, r in results.items()}, "dropped_steps": dropped,
                               "produced_records": produced, "ingest": bool(args.ingest),
                               "profile_cpu_s": {f"{m}:{n}": v for (m, n), v in profile.items()},
                               "pairs": args.pairs, "max_new_tokens": args.max_new_tokens})
    finally:
        for proc in (ingest, broker):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
