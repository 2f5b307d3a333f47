"""Concurrency sweep: target-only, fixed γ, today's stop rule and the cost scheduler, side by side.

For each concurrency B and round, the same B held-out prompts go through four reference engines
(one per mode, all alive at once and serving every concurrency, the mode order rotated per round
so drift in machine load hits all alike). Decode tokens/s of a round = tokens after every request's first token / seconds from
then until the last finishes (prefill excluded). Ratios to target-only come with 90% paired
bootstrap intervals over rounds. The cost engine measures its step cost at start-up and keeps it
and its running acceptance current from its own steps across the concurrencies.

    python -m bench.spec_sweep --workload chat --batch 1,2,4,8 --rounds 4 [--json out.json]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from bench.report import print_table, write_json
from tide import workloads
from tide.config import load_config
from tide.drafter.artifact import TargetSpec, load_drafter, read_metadata
from tide.drafter.static import static_drafter_path
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine, load_target
from tide.report import ModeResult, ratio_interval
from tide.train.offline import render_prompt

MODES = ("target", "fixed", "stop_rule", "cost")


def run_round(engine, prompts, n, workload, tag):
    """Decode ``prompts`` concurrently; returns (tokens after all first tokens, seconds)."""
    firsts, lock, started = [0], threading.Lock(), threading.Event()
    counts, t_start = [0] * len(prompts), [0.0]

    def one(k, ids):
        req = GenerationRequest(f"{tag}-{k}", tuple(ids), SamplingParams(max_new_tokens=n, ignore_eos=True),
                                workload=workload)
        first = True
        for ev in engine.submit(req):
            if first:
                first = False
                with lock:
                    firsts[0] += 1
                    if firsts[0] == len(prompts):
                        t_start[0] = time.perf_counter()
                        started.set()
                started.wait()
                continue
            counts[k] += len(ev.token_ids)
    threads = [threading.Thread(target=one, args=(k, ids)) for k, ids in enumerate(prompts)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return sum(counts), time.perf_counter() - t_start[0]


def _cell(res, health, rows_out, b) -> dict:
    cell = {k: health.get(k) for k in ("speculation", "acceptance_by_depth", "speculation_events", "step_cost",
                                  "drafted_tok_s_by_rows")}
    for m in MODES:
        ratio = res[m].tokens_per_s / res["target"].tokens_per_s
        lo, hi = ratio_interval(res[m], res["target"], "tokens_per_s") if m != "target" else (1.0, 1.0)
        cell[m] = {"tok_s": res[m].tokens_per_s, "ratio": ratio, "interval_90": [lo, hi],
                   "round_tokens": res[m].prompt_tokens, "round_s": res[m].prompt_decode_s}
        rows_out.append((b, m, f"{res[m].tokens_per_s:.2f}", f"{ratio:.3f}", f"{lo:.3f}-{hi:.3f}"))
    for other in ("fixed", "stop_rule"):
        lo, hi = ratio_interval(res["cost"], res[other], "tokens_per_s")
        ratio = res["cost"].tokens_per_s / res[other].tokens_per_s
        cell[f"cost_over_{other}"] = {"ratio": ratio, "interval_90": [lo, hi]}
        rows_out.append((b, f"cost / {other}", "", f"{ratio:.3f}", f"{lo:.3f}-{hi:.3f}"))
    return cell


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4, help="fixed and stop-rule draft length; the scheduler's most")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the static drafter)")
    ap.add_argument("--max-seq-len", type=int, default=384)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config(overrides={"model": {"torch_threads": 1}})
    batches = [int(b) for b in args.batch.split(",")]
    target, tok, _ = load_target(cfg)
    path = Path(args.drafter) if args.drafter else static_drafter_path(cfg)
    drafter = load_drafter(path, TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids))
    version = str(read_metadata(path).get("version", path.name))  # the gate's events name it
    held = workloads.load_workload(args.workload, "heldout", args.rounds * max(batches), seed=1)
    if len(held) < args.rounds * max(batches):  # an empty round would time nothing and read as 0 tok/s
        ap.error(f"{args.workload} has {len(held)} held-out prompts; --rounds {args.rounds} x batch {max(batches)} "
                 f"needs {args.rounds * max(batches)}")
    prompts = [render_prompt(tok, p.chat_messages(), 256) for p in held]
    common = dict(target_model_id=cfg.model.model_id, draft_len=args.gamma, max_seq_len=args.max_seq_len, eos_ids=())
    # one engine per mode with room for the largest batch, serving B concurrent requests at each
    # concurrency: the cost engine measures its step cost at start-up and keeps its running
    # acceptance across concurrencies, as a serving engine whose load changes does
    t0 = time.perf_counter()
    size = dict(common, max_batch_size=max(batches))
    engines = {
        "target": ReferenceEngine(target, tok, None, "none", **size),
        "fixed": ReferenceEngine(target, tok, drafter, version, **size, scheduler="fixed"),
        "stop_rule": ReferenceEngine(target, tok, drafter, version, **size, scheduler="stop_rule",
                                     draft_stop_prob=cfg.spec.draft_stop_prob),
        "cost": ReferenceEngine(target, tok, drafter, version, **size, scheduler="cost"),
    }
    profile_s = time.perf_counter() - t0
    results, rows_out, health = {}, [("B", "mode", "tok/s", "x target-only", "90% interval")], {}
    try:
        for b in batches:
            res = {m: ModeResult() for m in MODES}
            for r in range(args.rounds):
                group = prompts[r * b:(r + 1) * b]
                order = MODES[r % 4:] + MODES[:r % 4]
                for m in order:
                    n, s = run_round(engines[m], group, args.max_new_tokens, args.workload, f"{m}{b}r{r}")
                    res[m].add(tokens=n, decode_s=s, forwards=0, committed=0)
            health = engines["cost"].health()
            results[b] = _cell(res, health, rows_out, b)
            print(f"B={b} done: {results[b]['cost']['ratio']:.3f}x, gate {results[b]['speculation']}", flush=True)
    finally:
        for e in engines.values():
            e.close()
    print_table(f"concurrency sweep ({args.workload}, {args.rounds} rounds, {args.max_new_tokens} new tokens, "
                f"gamma {args.gamma}, engines + cost profile {profile_s:.1f} s)", rows_out)
    write_json(args.json, {"workload": args.workload, "rounds": args.rounds, "gamma": args.gamma,
                           "max_new_tokens": args.max_new_tokens, "drafter": str(path),
                           "stop_prob": cfg.spec.draft_stop_prob, "profile_s": profile_s,
                           "step_cost": health.get("step_cost"), "cells": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
