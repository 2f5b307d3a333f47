"""Target-only vs speculative decoding, side by side in one run, on held-out prompts.

For each held-out prompt (never trained on), every mode (target-only, then one per ``--drafter``,
``--siblings`` and ``--stop-prob`` value) decodes the same number of tokens, the order of modes rotating per prompt so drift in machine load
hits all alike. Reports per drafter: tokens committed per target forward, per-position acceptance,
decode tokens/s and the ratio to target-only (prefill excluded), a step's drafting and verify time
in target-only decode forwards, each ratio with a 90% paired-bootstrap
interval over prompts; with two or more drafter modes, each one's ratios to the first. ``--batch B``
repeats the comparison through the batched reference engine with B concurrent requests (first
drafter, first stop value).

    python -m bench.spec_decode [--prompts 16] [--max-new-tokens 64] [--drafter DIR ...] [--siblings 0 1 2]
                                [--stop-prob 0.3 0.1] [--json out.json]
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
from tide.drafter.artifact import TargetSpec, load_drafter
from tide.drafter.model import for_serving
from tide.drafter.static import static_drafter_path
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine, load_target
from tide.report import ModeResult, ratio_interval
from tide.spec.generate import generate
from tide.train.offline import render_prompt

TARGET = "target-only"


def timed_generate(target, drafter, ids, n, gamma, stop_prob=0.0, siblings=0):
    t0 = time.perf_counter()
    out, stats = generate(target, drafter, ids, n, gamma=gamma, stop_prob=stop_prob, siblings=siblings)
    return out, stats, time.perf_counter() - t0


def single_stream(target, drafters: dict, prompts, n, gamma):
    """Per prompt, target-only and each drafter mode ({name: (drafter, siblings, stop_prob)}; order rotated);
    prefill time is measured separately (a 1-token run) and subtracted. Returns per mode: its
    ``ModeResult``; per drafter mode the acceptance rate by draft position, and a step's drafting and
    verify time in target-only decode forwards."""
    modes = [(TARGET, (None, 0, 0.0)), *drafters.items()]
    res = {name: ModeResult() for name, _ in modes}
    pos_accepts = {name: [0] * gamma for name in drafters}
    step_s = {name: [0.0, 0.0] for name in drafters}  # draft, verify seconds over every step
    for i, ids in enumerate(prompts):
        _, _, prefill_s = timed_generate(target, None, ids, 1, gamma)
        outs = {}
        for name, (d, siblings, stop_prob) in modes[i % len(modes):] + modes[:i % len(modes)]:
            out, stats, s = timed_generate(target, d, ids, n, gamma, stop_prob, siblings)
            outs[name] = out
            res[name].add(tokens=len(out) - 1, decode_s=max(1e-6, s - prefill_s), forwards=stats.target_forwards,
                          committed=len(out) - 1 if d is None else sum(stats.accept_lengths))
            if d is not None:
                pos_accepts[name] = [a + b for a, b in zip(pos_accepts[name], stats.position_accepts)]
                step_s[name] = [step_s[name][0] + stats.draft_s, step_s[name][1] + stats.verify_s]
        for name in drafters:
            res[name].identical_to_target += outs[name] == outs[TARGET]
    rates = {name: [a / max(1, res[name].forwards) for a in pos_accepts[name]] for name in drafters}
    # a step's parts in target-only decode forwards: what the speedup is tokens/forward divided by
    plain_s = res[TARGET].decode_s / max(1, res[TARGET].forwards)
    costs = {name: [t / max(1, res[name].forwards) / plain_s for t in step_s[name]] for name in drafters}
    return res, rates, costs


def batched(engine_args, prompts, n, batch):
    """Tokens/s of the engine with ``batch`` concurrent greedy requests (wall clock)."""
    engine = ReferenceEngine(*engine_args[0], **engine_args[1], max_batch_size=batch)
    try:
        t0, total, lock = time.perf_counter(), [0], threading.Lock()

        def run(ids, k):
            req = GenerationRequest(f"b{k}", tuple(ids), SamplingParams(max_new_tokens=n))
            got = sum(len(ev.token_ids) for ev in engine.submit(req))  # blocks until the request ends
            with lock:  # (``total[0] += sum(...)`` would read total before blocking: last writer wins)
                total[0] += got
        threads = [threading.Thread(target=run, args=(ids, k)) for k, ids in enumerate(prompts)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        return total[0] / (time.perf_counter() - t0)
    finally:
        engine.close()


def drafter_summary(name: str, path: Path, res: dict, rates: list[float], cost: list[float]) -> dict:
    """One drafter's figures against target-only, with 90% intervals over prompts."""
    spec, plain = res[name], res[TARGET]
    return {"drafter": str(path), "tokens_per_forward": spec.tokens_per_forward,
            "draft_cost_per_step": cost[0], "verify_cost_per_step": cost[1],
            "tokens_per_forward_interval_90": list(ratio_interval(spec, plain, "tokens_per_forward")),
            "position_acceptance": rates, "spec_tok_s": spec.tokens_per_s,
            "speedup": spec.tokens_per_s / plain.tokens_per_s,
            "speedup_interval_90": list(ratio_interval(spec, plain, "tokens_per_s")),
            "identical_outputs": spec.identical_to_target}


def drafter_rows(name: str, d: dict, prompts: int) -> list[tuple[str, str]]:
    lo, hi = d["tokens_per_forward_interval_90"]
    s_lo, s_hi = d["speedup_interval_90"]
    return [(f"[{name}] tokens per target forward", f"{d['tokens_per_forward']:.3f} (90% {lo:.3f}-{hi:.3f})"),
            (f"[{name}] acceptance by draft position", " ".join(f"{r:.2f}" for r in d["position_acceptance"])),
            (f"[{name}] speculative decode tok/s", f"{d['spec_tok_s']:.2f}"),
            (f"[{name}] a step, in target-only decode forwards: draft + verify",
             f"{d['draft_cost_per_step']:.3f} + {d['verify_cost_per_step']:.3f}"),
            (f"[{name}] speedup over target-only", f"{d['speedup']:.3f}x (90% {s_lo:.3f}-{s_hi:.3f})"),
            (f"[{name}] greedy outputs identical", f"{d['identical_outputs']}/{prompts}")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=None, help="draft length (default: config spec.draft_len)")
    ap.add_argument("--stop-prob", type=float, nargs="+", default=None,
                    help="stop drafting below this draft probability; several values: a mode per drafter, "
                         "siblings and value (default: config spec.draft_stop_prob)")
    ap.add_argument("--drafter", action="append", default=None,
                    help="drafter folder; repeat to compare several in one run (default: the static drafter)")
    ap.add_argument("--siblings", type=int, nargs="+", default=None,
                    help="depth-1 siblings per step (tide/spec/tree.py); several values: a mode per drafter "
                         "and value (default: config spec.draft_siblings)")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--batch", type=int, default=0, help="also compare through the engine at this batch size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config(overrides={"model": {"torch_threads": args.threads}})
    gamma = args.gamma or cfg.spec.draft_len
    stops = [cfg.spec.draft_stop_prob] if args.stop_prob is None else args.stop_prob
    siblings = args.siblings if args.siblings is not None else [cfg.spec.draft_siblings]
    if not all(0.0 <= q <= 1.0 for q in stops):
        ap.error(f"--stop-prob values must be in [0, 1], got {stops}")
    if len(set(stops)) < len(stops) or len(set(siblings)) < len(siblings):
        ap.error("--stop-prob and --siblings values must be distinct (each names a mode)")
    if any(k < 0 for k in siblings):
        ap.error(f"--siblings values must be >= 0, got {siblings}")
    target, tok, _ = load_target(cfg)
    paths = [Path(p) for p in args.drafter] if args.drafter else [static_drafter_path(cfg)]
    spec_of_target = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)
    # as the engine serves them: linears on the row kernel over bf16 weights (where it runs)
    served = [for_serving(load_drafter(p, spec_of_target)) for p in paths]
    modes = [(f"{i + 1}:{p.name}" + (f"+{k}sib" if k else "") + (f"@stop{q:g}" if len(stops) > 1 else ""), p, d, k, q)
             for i, (p, d) in enumerate(zip(paths, served)) for k in siblings for q in stops]
    names = [name for name, *_ in modes]
    drafters = {name: (d, k, q) for name, _, d, k, q in modes}
    held = workloads.load_workload(args.workload, "heldout", args.prompts, seed=1)
    prompts = [render_prompt(tok, p.chat_messages(), 256) for p in held]
    res, rates, costs = single_stream(target, drafters, prompts, args.max_new_tokens, gamma)
    per = {name: drafter_summary(name, p, res, rates[name], costs[name]) | {"siblings": k, "stop_prob": q}
           for name, p, _, k, q in modes}
    stop_prob = stops[0]  # the batched comparison's and the summary's (the first mode's)
    first = per[names[0]]
    summary = {"workload": args.workload, "prompts": len(prompts), "gamma": gamma, "stop_prob": stop_prob,
               "target_tok_s": res[TARGET].tokens_per_s, **first, "drafters": per}
    rows = [("metric", "value"), ("prompts (held-out)", len(prompts)), ("draft length (max)", gamma),
            ("draft stop probability", " ".join(f"{q:g}" for q in stops)), ("target-only decode tok/s", f"{res[TARGET].tokens_per_s:.2f}")]
    for name in names:
        rows += drafter_rows(name, per[name], len(prompts))
    for name in names[1:]:  # side by side: each drafter over the first, same prompts
        comp = {m: (getattr(res[name], m) / getattr(res[names[0]], m),
                    *ratio_interval(res[name], res[names[0]], m)) for m in ("tokens_per_forward", "tokens_per_s")}
        per[name]["over_first"] = comp
        rows += [(f"[{name} / {names[0]}] {m.replace('_', ' ')}", f"{v:.3f}x (90% {lo:.3f}-{hi:.3f})")
                 for m, (v, lo, hi) in comp.items()]
    if args.batch:
        drafter = drafters[names[0]][0]
        common = dict(target_model_id=cfg.model.model_id, draft_len=gamma, draft_stop_prob=stop_prob, max_seq_len=cfg.model.max_seq_len, eos_ids=())
        plain = batched(((target, tok, None, "none"), common), prompts, args.max_new_tokens, args.batch)
        spec = batched(((target, tok, drafter, "static"), common), prompts, args.max_new_tokens, args.batch)
        summary.update(batch=args.batch, batched_target_tok_s=plain, batched_spec_tok_s=spec, batched_speedup=spec / plain)
        rows += [(f"engine batch={args.batch} target-only tok/s", f"{plain:.2f}"),
                 (f"engine batch={args.batch} speculative tok/s ({names[0]})", f"{spec:.2f}"),
                 (f"engine batch={args.batch} speedup", f"{spec / plain:.3f}x")]
    print_table(f"speculative decoding bench ({args.workload}, {args.max_new_tokens} new tokens/prompt)", rows)
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
