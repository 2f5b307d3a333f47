"""One engine drafting through the drafter service against the co-located engine, at 1 concurrent.

The drafter service (``python -m tide.services.drafter``) runs as its own process with the shipped
static drafter; two reference engines share this process's target (own caches): the co-located
one drafts itself, the remote one asks the service (``--transport ipc``: shared memory on this
host, or ``tcp``: ZeroMQ over loopback). Per held-out chat prompt both decode the same greedy
tokens, one request at a time, the order alternating per prompt; decode tok/s counts from a
request's first token to its last (prefill excluded). Reports each mode's tok/s, the paired ratio
remote / co-located with its 90% bootstrap interval over prompts (the floor: 0.97x), outputs
identical, and the remote engine's fallback steps (target-only for want of drafts).

    python -m bench.drafter_service [--prompts 24] [--max-new-tokens 64] [--transport ipc|tcp]
                                    [--scheduler dspark|stop_rule|...] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import print_table, write_json
from tide import workloads
from tide.config import load_config
from tide.drafter.artifact import TargetSpec, load_drafter, read_metadata
from tide.drafter.static import static_drafter_path
from tide.drafting.client import RemoteDrafter
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine, load_target
from tide.report import ModeResult, ratio_interval
from tide.train.offline import render_prompt

FLOOR = 0.97


def start_service(transport: str, sock: Path, port: int) -> subprocess.Popen:
    """The drafter service with the default config (static drafter), no registry, no /metrics."""
    env = {**os.environ, "TIDE_OPS__FOLLOW_REGISTRY": "false"}
    cmd = [sys.executable, "-m", "tide.services.drafter", "--metrics-port", "0", "--log-level", "WARNING",
           "--port", str(port if transport == "tcp" else 0), "--ipc-path", str(sock) if transport == "ipc" else "-"]
    return subprocess.Popen(cmd, env=env)


def timed(engine, rid: str, ids: list[int], n: int) -> tuple[list[int], float]:
    """(tokens, decode seconds: first token to last)."""
    out, first = [], None
    for ev in engine.submit(GenerationRequest(rid, tuple(ids), SamplingParams(max_new_tokens=n))):
        if first is None and ev.token_ids:
            first = time.perf_counter()
        out += ev.token_ids
    return out, time.perf_counter() - (first or time.perf_counter())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    ap.add_argument("--port", type=int, default=7411)
    ap.add_argument("--scheduler", default=None, help="both engines' spec.scheduler (default: the config's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config(overrides={"model": {"torch_threads": 1},
                                 **({"spec": {"scheduler": args.scheduler}} if args.scheduler else {})})
    target, tok, _ = load_target(cfg)
    sock = Path(tempfile.mkdtemp()) / "drafter.sock"
    proc = start_service(args.transport, sock, args.port)
    url = f"ipc://{sock}" if args.transport == "ipc" else f"tcp://127.0.0.1:{args.port}"
    engines = {}
    try:
        path = static_drafter_path(cfg)
        drafter = load_drafter(path, TargetSpec(target.shape.hidden_size, target.shape.vocab_size,
                                                target.aux_layer_ids))
        common = dict(target_model_id=cfg.model.model_id, draft_len=cfg.spec.draft_len,
                      draft_stop_prob=cfg.spec.draft_stop_prob, max_batch_size=1, max_seq_len=cfg.model.max_seq_len,
                      scheduler=cfg.spec.scheduler, judge_rows=cfg.ops.guard_window_forwards)
        engines["co-located"] = ReferenceEngine(target, tok, drafter, str(read_metadata(path).get("version", "static")),
                                                **common)
        remote = RemoteDrafter(url, target.shape.vocab_size, cfg.spec.drafter_service_deadline_s,
                               cfg.spec.drafter_service_retry_s, connect_timeout_s=180.0,
                               stop_prob=cfg.spec.draft_stop_prob)
        if not remote.up:
            raise SystemExit(f"the drafter service at {url} did not answer")
        engines["service"] = ReferenceEngine(target, tok, None, "unused", remote=remote, **common)
        held = workloads.load_workload("chat", "heldout", args.prompts, seed=1)
        prompts = [render_prompt(tok, p.chat_messages(), 256) for p in held]
        res = {name: ModeResult() for name in engines}
        identical = 0
        names = list(engines)
        timed(engines["service"], "warm-s", prompts[0], 8)  # each mode's first request pays for warm-up
        timed(engines["co-located"], "warm-c", prompts[0], 8)
        for i, ids in enumerate(prompts):
            outs = {}
            for name in (names if i % 2 == 0 else names[::-1]):
                out, s = timed(engines[name], f"{name}-{i}", ids, args.max_new_tokens)
                outs[name] = out
                res[name].add(tokens=len(out) - 1, decode_s=max(s, 1e-6), forwards=1, committed=1)
            identical += outs["service"] == outs["co-located"]
        ratio = res["service"].tokens_per_s / res["co-located"].tokens_per_s
        lo, hi = ratio_interval(res["service"], res["co-located"], "tokens_per_s")
        view = engines["service"].health()["drafter_service"]
    finally:
        for e in engines.values():
            e.close()
        proc.terminate()
        proc.wait(timeout=30)
    summary = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "transport": args.transport,
               "co_located_tok_s": res["co-located"].tokens_per_s, "service_tok_s": res["service"].tokens_per_s,
               "ratio": ratio, "ratio_interval_90": [lo, hi], "floor": FLOOR, "identical_outputs": identical,
               "remote_drafted_steps": view["drafted_steps"], "remote_fallback_steps": view["fallback_steps"],
               "scheduler": cfg.spec.scheduler}
    rows = [("metric", "value"), ("prompts (held-out chat) x tokens", f"{len(prompts)} x {args.max_new_tokens}"),
            ("co-located engine decode tok/s", f"{summary['co_located_tok_s']:.2f}"),
            (f"engine + drafter service ({args.transport}) decode tok/s", f"{summary['service_tok_s']:.2f}"),
            ("service / co-located", f"{ratio:.3f}x (90% {lo:.3f}-{hi:.3f}); floor {FLOOR}"),
            ("greedy outputs identical", f"{identical}/{len(prompts)}"),
            ("remote drafted steps / fallback steps", f"{view['drafted_steps']} / {view['fallback_steps']}")]
    print_table(f"drafter service vs co-located drafter (1 concurrent, {cfg.spec.scheduler})", rows)
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
