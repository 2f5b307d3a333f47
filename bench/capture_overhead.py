"""Decode throughput with hidden-state capture on (100% sampling, real broker) vs off, side by side.

One engine process-local target; rounds alternate capture on / off over the same prompts (batch of
concurrent greedy requests) so machine-load drift hits both. Capture on means the engine's tap
enqueues every committed position and the producer thread serialises and sends to a real
Kafka-protocol broker (tansu, started here on loopback).

    python -m bench.capture_overhead [--rounds 3] [--requests 8] [--max-new-tokens 48] [--json out.json]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    port = free_port()
    state = Path(tempfile.mkdtemp(prefix="tide-bench-broker-"))
    broker = subprocess.Popen([sys.executable, "-m", "tide.broker", "run", "memory", "--port", str(port),
                               "--state-dir", str(state)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _tcp_ready(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        cfg = load_config(overrides={"capture": {"enabled": True, "sample_fraction": 1.0},
                                     "kafka": {"bootstrap_servers": f"127.0.0.1:{port}"}})
        target, tok, _ = load_target(cfg)
        drafter = load_drafter(static_drafter_path(cfg), TargetSpec(target.shape.hidden_size,
                                                                    target.shape.vocab_size, target.aux_layer_ids))
        prompts = [render_prompt(tok, p.chat_messages(), 256)
                   for p in workloads.load_workload("chat", "heldout", args.requests, seed=2)]
        engine = ReferenceEngine(target, tok, drafter, "static", target_model_id=cfg.model.model_id,
                                 draft_len=cfg.spec.draft_len, max_batch_size=args.requests,
                                 max_seq_len=cfg.model.max_seq_len)
        tap = CaptureTap(cfg.capture, cfg.kafka)
        on, off = [], []
        try:
            run_round(engine, prompts[:2], 8)  # warm-up
            for r in range(args.rounds):
                for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    engine.set_capture_sink(tap if mode == "on" else None)
                    (on if mode == "on" else off).append(run_round(engine, prompts, args.max_new_tokens))
        finally:
            engine.close()
            tap.close(30)
        dropped = sum(s.value for m in metrics.CAPTURE_DROPPED_STEPS.collect() for s in m.samples
                      if s.name.endswith("_total"))
        produced = sum(s.value for m in metrics.CAPTURE_PRODUCED_RECORDS.collect() for s in m.samples
                       if s.name.endswith("_total"))
        ratio = sum(on) / sum(off)
        summary = {"capture_on_tok_s": on, "capture_off_tok_s": off, "ratio": ratio, "dropped_steps": dropped,
                   "produced_records": produced,
                   "requests": args.requests, "max_new_tokens": args.max_new_tokens}
        print_table("capture overhead (engine decode throughput)", [
            ("metric", "value"), ("rounds (alternating)", args.rounds),
            ("capture off tok/s (per round)", " ".join(f"{x:.1f}" for x in off)),
            ("capture on  tok/s (per round)", " ".join(f"{x:.1f}" for x in on)),
            ("ratio on/off (sum over rounds)", f"{ratio:.3f}"), ("records produced", produced),
            ("steps dropped", dropped)])
        write_json(args.json, summary)
    finally:
        broker.terminate()
        broker.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
