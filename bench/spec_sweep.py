"""Concurrency sweep: the engine's schedulers side by side against target-only, by concurrency.

Modes (``--modes``; default: target-only, today's cost scheduler and the engine's default, DSpark's
admission with a packed verify): ``target``, ``fixed`` (γ every step), ``stop_rule``, ``cost``,
``dspark``, ``dspark-nohead`` (DSpark with the same drafter's confidence head withheld: its
drafts ranked on the top-probability chain), and ``target-aa``: a second target-only engine, the
A/A control whose ratio over ``target`` is the bench's own spread (what a mode exactly as fast as
target-only reads in this run). For each concurrency B and round, the same B
held-out prompts go through one reference engine per mode (all alive at once and serving every
concurrency, the mode order rotated per round so drift in machine load hits all alike). Decode
tokens/s of a round = tokens after every request's first token / seconds from then until the last
finishes (prefill excluded). A round run to its end charges the scheduler its tail: as requests
finish at different steps the batch drains, and the last ones decode at fewer rows than B.
``--steady`` times a window with every request in flight instead: requests get three times the
tokens, the window is what a target-only round takes (a warm-up round at each B), and only the
steps wholly received within it count. Ratios come with 90% paired bootstrap intervals over rounds: every
mode over target-only, DSpark over the cost scheduler and over itself without the head. Greedy
outputs are compared with target-only's request by request (``identical`` counts). The costed
engines measure their step cost at start-up and keep it and their running acceptance current
from their own steps across the concurrencies.

    python -m bench.spec_sweep --workload chat --batch 1,2,4,8 --rounds 6 [--steady] [--drafter DIR] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
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

MODES = ("target", "target-aa", "fixed", "stop_rule", "cost", "dspark", "dspark-nohead")
PAIRS = (("dspark", "cost"), ("dspark", "dspark-nohead"), ("cost", "stop_rule"))  # (over, under) when both run


STEP_GAP_S = 0.01  # one step's events reach their readers within this of each other; steps are further apart


def run_round(engine, prompts, n, workload, tag, window_s: float | None = None):
    """Decode ``prompts`` concurrently; returns (decode tokens, seconds, each request's tokens).

    ``window_s`` None: the round runs until the last request finishes (every token after each
    request's first, until the last finishes). Else the steady window: requests may run far past
    it, and only the steps wholly received within ``window_s`` after every first token count (all
    B requests in flight throughout; the window closes early at a request's end), then the
    requests are cancelled."""
    firsts, lock, started = [0], threading.Lock(), threading.Event()
    t_start, outs = [0.0], [[] for _ in prompts]
    seen: list[list[tuple[float, int, bool]]] = [[] for _ in prompts]  # (received at, tokens, last)

    def one(k, ids):
        req = GenerationRequest(f"{tag}-{k}", tuple(ids), SamplingParams(max_new_tokens=n, ignore_eos=True),
                                workload=workload)
        events = engine.submit(req)
        first = True
        for ev in events:
            outs[k].extend(ev.token_ids)
            if first:
                first = False
                with lock:
                    firsts[0] += 1
                    if firsts[0] == len(prompts):
                        t_start[0] = time.perf_counter()
                        started.set()
                started.wait()
                continue
            now = time.perf_counter()
            seen[k].append((now, len(ev.token_ids), ev.finished))
            if window_s is not None and now > t_start[0] + window_s:
                events.close()  # the request is dropped at the engine's next step
                break
    threads = [threading.Thread(target=one, args=(k, ids)) for k, ids in enumerate(prompts)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if window_s is None:
        return sum(c for evs in seen for _, c, _ in evs), time.perf_counter() - t_start[0], outs
    tokens, seconds = steady_window(seen, t_start[0], window_s)
    return tokens, seconds, outs


def steady_window(seen: list[list[tuple[float, int, bool]]], t_start: float, window_s: float) -> tuple[int, float]:
    """(tokens, seconds) of the steps wholly received by ``t_start + window_s`` or the first
    request's end, whichever is first: the window closes at a step's end, as it opens at one."""
    ends = [t for evs in seen for t, _, last in evs if last]
    close = min([t_start + window_s, *ends])
    received = sorted((t, c) for evs in seen for t, c, _ in evs if t >= t_start)
    last = max(t for t, _ in received if t <= close)
    kept = [(t, c) for t, c in received if t <= last + STEP_GAP_S]
    return sum(c for _, c in kept), kept[-1][0] - t_start


def settle(engine, timeout_s: float = 30.0) -> None:
    """Wait until the engine has no request left (a steady window's cancelled ones leave at its next step)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = engine.health()
        if h["running"] == 0 and h["waiting"] == 0:
            return
        time.sleep(0.01)
    raise RuntimeError("the engine still serves a cancelled round's requests")


def build_engines(modes, target, tok, drafter, version, size: dict, stop_prob: float) -> dict:
    """One engine per mode; the costed ones profile their step cost here."""
    engines = {}
    for m in modes:
        if m in ("target", "target-aa"):
            engines[m] = ReferenceEngine(target, tok, None, "none", **size)
            continue
        d = drafter
        if m == "dspark-nohead":
            d = copy.deepcopy(drafter)
            d.confidence = None
        engines[m] = ReferenceEngine(target, tok, d, version, **size, scheduler=m.removesuffix("-nohead"),
                                     draft_stop_prob=stop_prob)
    return engines


def _cell(modes, res, identical, health, rows_out, b) -> dict:
    cell = {"health": health, "identical_to_target": identical}
    for m in modes:
        ratio = res[m].tokens_per_s / res["target"].tokens_per_s
        lo, hi = ratio_interval(res[m], res["target"], "tokens_per_s") if m != "target" else (1.0, 1.0)
        cell[m] = {"tok_s": res[m].tokens_per_s, "ratio": ratio, "interval_90": [lo, hi],
                   "round_tokens": res[m].prompt_tokens, "round_s": res[m].prompt_decode_s}
        same = f"{identical[m]}/{len(res[m].prompt_tokens) * b}" if m != "target" else ""
        rows_out.append((b, m, f"{res[m].tokens_per_s:.2f}", f"{ratio:.3f}", f"{lo:.3f}-{hi:.3f}", same))
    for over, under in PAIRS:
        if over in modes and under in modes:
            lo, hi = ratio_interval(res[over], res[under], "tokens_per_s")
            ratio = res[over].tokens_per_s / res[under].tokens_per_s
            cell[f"{over}_over_{under}"] = {"ratio": ratio, "interval_90": [lo, hi]}
            rows_out.append((b, f"{over} / {under}", "", f"{ratio:.3f}", f"{lo:.3f}-{hi:.3f}", ""))
    return cell


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4, help="fixed and stop-rule draft length; the schedulers' most")
    ap.add_argument("--modes", default="target,cost,dspark", help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the static drafter)")
    ap.add_argument("--max-seq-len", type=int, default=384)
    ap.add_argument("--steady", action="store_true",
                    help="time a steady window (every request in flight) instead of rounds run to their end; "
                         "the window is a target-only round's decode time, requests get 3x the tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = tuple(dict.fromkeys(["target", *args.modes.split(",")]))
    if not set(modes) <= set(MODES):
        ap.error(f"--modes must be from {MODES}, got {args.modes}")
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
    size = dict(target_model_id=cfg.model.model_id, draft_len=args.gamma, max_seq_len=args.max_seq_len, eos_ids=(),
                max_batch_size=max(batches))
    # one engine per mode with room for the largest batch, serving B concurrent requests at each
    # concurrency: the costed engines keep their step costs and acceptance across concurrencies,
    # as a serving engine whose load changes does
    t0 = time.perf_counter()
    engines = build_engines(modes, target, tok, drafter, version, size, cfg.spec.draft_stop_prob)
    profile_s = time.perf_counter() - t0
    results, rows_out = {}, [("B", "mode", "tok/s", "x target-only", "90% interval", "identical")]
    try:
        for b in batches:
            res, identical = {m: ModeResult() for m in modes}, {m: 0 for m in modes}
            window_s, budget = None, args.max_new_tokens
            if args.steady:  # the window: what target-only takes for the rounds' tokens (a warm-up round)
                _, window_s, _ = run_round(engines["target"], prompts[:b], budget, args.workload, f"w{b}")
                budget *= 3
            for r in range(args.rounds):
                group = prompts[r * b:(r + 1) * b]
                order = modes[r % len(modes):] + modes[:r % len(modes)]
                outs = {}
                for m in order:
                    n, s, outs[m] = run_round(engines[m], group, budget, args.workload, f"{m}{b}r{r}", window_s)
                    res[m].add(tokens=n, decode_s=s, forwards=0, committed=0)
                    if window_s is not None:
                        settle(engines[m])
                for m in modes:  # a steady window's outputs stop anywhere: compared as far as both go
                    identical[m] += sum(a[:len(t)] == t[:len(a)] for a, t in zip(outs[m], outs["target"]))
            health = {m: {k: e.health().get(k) for k in ("speculation", "acceptance_by_depth", "confidence_head",
                                                          "drafted_tok_s_by_rows", "judged_rows")}
                      for m, e in engines.items() if not m.startswith("target")}
            results[b] = _cell(modes, res, identical, health, rows_out, b)
            print(f"B={b} done: " + ", ".join(f"{m} {results[b][m]['ratio']:.3f}x" for m in modes if m != "target"),
                  flush=True)
    finally:
        for e in engines.values():
            e.close()
    print_table(f"concurrency sweep ({args.workload}, {args.rounds} rounds, {args.max_new_tokens} new tokens"
                f"{', steady window' if args.steady else ''}, "
                f"gamma {args.gamma}, engines + cost profiles {profile_s:.1f} s)", rows_out)
    step_cost = {m: engines[m].health().get("step_cost") for m in modes if m in ("cost", "dspark")}
    write_json(args.json, {"workload": args.workload, "rounds": args.rounds, "gamma": args.gamma, "modes": modes,
                           "max_new_tokens": args.max_new_tokens, "steady": args.steady, "drafter": str(path),
                           "stop_prob": cfg.spec.draft_stop_prob, "default_scheduler": cfg.spec.scheduler,
                           "profile_s": profile_s, "step_cost": step_cost, "cells": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
