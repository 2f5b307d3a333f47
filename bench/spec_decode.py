"""Target-only vs speculative decoding, side by side in one run, on held-out prompts.

For each held-out ShareGPT chat prompt (never trained on), both modes decode the same number of
tokens, alternating which goes first so drift in machine load hits both alike. Reports mean
tokens committed per target forward, per-position acceptance, decode tokens/s of each mode and
their ratio (prefill excluded from both). ``--batch B`` repeats the comparison through the
batched reference engine with B concurrent requests.

    python -m bench.spec_decode [--prompts 16] [--max-new-tokens 64] [--gamma 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import statistics
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


def timed_generate(target, drafter, ids, n, gamma, stop_prob=0.0):
    t0 = time.perf_counter()
    out, stats = generate(target, drafter, ids, n, gamma=gamma, stop_prob=stop_prob)
    return out, stats, time.perf_counter() - t0


def single_stream(target, drafter, prompts, n, gamma, stop_prob=0.0):
    """Per prompt: prefill time is measured separately (a 1-token run) and subtracted."""
    res = {"target": ModeResult(), "spec": ModeResult()}
    accept_lengths, pos_accepts, forwards, identical = [], [0] * gamma, 0, 0
    for i, ids in enumerate(prompts):
        _, _, prefill_s = timed_generate(target, None, ids, 1, gamma)
        order = [("target", None), ("spec", drafter)]
        outs = {}
        for name, d in (order if i % 2 == 0 else order[::-1]):
            out, stats, s = timed_generate(target, d, ids, n, gamma, stop_prob)
            outs[name] = out
            res[name].add(tokens=len(out) - 1, decode_s=max(1e-6, s - prefill_s), forwards=stats.target_forwards,
                          committed=len(out) - 1 if d is None else sum(stats.accept_lengths))
            if name == "spec":
                accept_lengths += stats.accept_lengths
                pos_accepts = [a + b for a, b in zip(pos_accepts, stats.position_accepts)]
                forwards += stats.target_forwards
        identical += outs["target"] == outs["spec"]
    return res, accept_lengths, [a / max(1, forwards) for a in pos_accepts], identical


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=None, help="draft length (default: config spec.draft_len)")
    ap.add_argument("--stop-prob", type=float, default=None,
                    help="stop drafting below this draft probability (default: config spec.draft_stop_prob)")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the static drafter)")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--batch", type=int, default=0, help="also compare through the engine at this batch size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config(overrides={"model": {"torch_threads": args.threads}})
    gamma = args.gamma or cfg.spec.draft_len
    stop_prob = cfg.spec.draft_stop_prob if args.stop_prob is None else args.stop_prob
    target, tok, _ = load_target(cfg)
    path = Path(args.drafter) if args.drafter else static_drafter_path(cfg)
    # as the engine serves it: linears on the row kernel over bf16 weights (where it runs)
    drafter = for_serving(load_drafter(path, TargetSpec(target.shape.hidden_size, target.shape.vocab_size,
                                                        target.aux_layer_ids)))
    held = workloads.load_workload(args.workload, "heldout", args.prompts, seed=1)
    prompts = [render_prompt(tok, p.chat_messages(), 256) for p in held]
    res, accept_lengths, pos_rates, identical = single_stream(target, drafter, prompts, args.max_new_tokens, gamma, stop_prob)
    tps = {k: v.tokens_per_s for k, v in res.items()}
    # how much the speedup depends on which prompts were drawn (and on per-prompt timing noise)
    speedup_lo, speedup_hi = ratio_interval(res["spec"], res["target"], "tokens_per_s")
    summary = {
        "workload": args.workload, "prompts": len(prompts), "gamma": gamma, "stop_prob": stop_prob, "drafter": str(path),
        "tokens_per_forward": statistics.mean(accept_lengths) if accept_lengths else 1.0,
        "position_acceptance": pos_rates, "target_tok_s": tps["target"], "spec_tok_s": tps["spec"],
        "speedup": tps["spec"] / tps["target"], "speedup_interval_90": [speedup_lo, speedup_hi],
        "identical_outputs": identical,
    }
    rows = [("metric", "value"), ("prompts (held-out)", len(prompts)), ("draft length (max)", gamma),
            ("draft stop probability", stop_prob),
            ("tokens per target forward", f"{summary['tokens_per_forward']:.3f}"),
            ("acceptance by draft position", " ".join(f"{r:.2f}" for r in pos_rates)),
            ("target-only decode tok/s", f"{tps['target']:.2f}"), ("speculative decode tok/s", f"{tps['spec']:.2f}"),
            ("speedup (spec / target-only)", f"{summary['speedup']:.3f}x"),
            ("speedup, 90% interval over prompts", f"{speedup_lo:.3f}x - {speedup_hi:.3f}x"),
            ("greedy outputs identical", f"{identical}/{len(prompts)}")]
    if args.batch:
        common = dict(target_model_id=cfg.model.model_id, draft_len=gamma, draft_stop_prob=stop_prob, max_seq_len=cfg.model.max_seq_len, eos_ids=())
        plain = batched(((target, tok, None, "none"), common), prompts, args.max_new_tokens, args.batch)
        spec = batched(((target, tok, drafter, "static"), common), prompts, args.max_new_tokens, args.batch)
        summary.update(batch=args.batch, batched_target_tok_s=plain, batched_spec_tok_s=spec, batched_speedup=spec / plain)
        rows += [(f"engine batch={args.batch} target-only tok/s", f"{plain:.2f}"),
                 (f"engine batch={args.batch} speculative tok/s", f"{spec:.2f}"),
                 (f"engine batch={args.batch} speedup", f"{spec / plain:.3f}x")]
    print_table(f"speculative decoding bench ({args.workload}, {args.max_new_tokens} new tokens/prompt)", rows)
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
