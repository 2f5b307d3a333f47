"""Does the trainer's simulated acceptance predict decoding? Both on the same text, per prompt.

For each held-out prompt (greedy, so the text is the target's own):
1. decoded: ``tide.spec.generate`` with the drafter as served, no stop rule (every step drafts
   ``gamma``): tokens committed per target forward;
2. the target's answer teacher-forced through the drafter (``tide.train.objective``), as the
   trainer's held-out evaluation scores it:
   - simulated: 1 + accepted drafts averaged over every generated position (what the trainer
     reports and a retrain's promotion compares);
   - replayed: the same per-position chains, stepped as decoding steps them (a step at t commits
     its accepted drafts plus the target's token; the next one starts where it ended).
Replayed should equal decoded (the served drafter computes what training unrolls); simulated
sits above both wherever acceptance is uneven along the answer, since decoding crosses an easy
stretch in few steps and a hard one in many. Each over decoded with a 90% paired bootstrap
interval over prompts.

    python -m bench.sim_replay [--prompts 24] [--max-new-tokens 64] [--drafter DIR] [--workload chat]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from bench.report import print_table, write_json
from tide import workloads
from tide.config import load_config
from tide.drafter.artifact import TargetSpec, load_drafter
from tide.drafter.model import for_serving
from tide.drafter.static import static_drafter_path
from tide.engine.reference import load_target
from tide.report import ModeResult, ratio_interval
from tide.spec.generate import generate
from tide.train.objective import replayed_acceptance, simulated_acceptance
from tide.train.offline import generate_samples, render_prompt
from tide.train.trainer import collate, prepare

MODES = ("decoded", "replayed", "simulated")


def score_prompt(target, drafter, served, ids: list[int], n: int, gamma: int, res: dict[str, ModeResult]) -> bool:
    """Adds the prompt to each mode; returns whether decoding and teacher forcing saw the same text."""
    out, stats = generate(target, served, ids, n, gamma=gamma)
    # the answer runs gamma past n so the last decoded step's drafts are scored too
    (sample,) = generate_samples(target, [ids], n + gamma, eos_ids=(), progress=False)
    same = sample.tokens[len(ids):].tolist()[:n - 1] == out[:n - 1]
    prepare([sample], drafter, target.lm_head_weight)
    sample.in_vocab = torch.isin(sample.target_top, drafter.draft_to_target)
    batch = collate([sample], len(sample))
    # the simulated average over the positions decoding starts from: those predicting the first n tokens
    first_n = batch.loss_mask.clone()
    first_n[0, len(ids) + n - 1:] = 0
    sim, _, positions = simulated_acceptance(drafter, target.embed_weight, target.lm_head_weight,
                                             dataclasses.replace(batch, loss_mask=first_n), gamma)
    tokens, steps = replayed_acceptance(drafter, target.embed_weight, target.lm_head_weight, batch, gamma,
                                        max_tokens=n - 1)
    res["decoded"].add(tokens=len(out), decode_s=0.0, forwards=stats.target_forwards, committed=sum(stats.accept_lengths))
    res["replayed"].add(tokens=tokens, decode_s=0.0, forwards=steps, committed=tokens)
    res["simulated"].add(tokens=positions, decode_s=0.0, forwards=positions, committed=round(sim * positions))
    return same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=None, help="draft length (default: config spec.draft_len)")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the static drafter)")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 2 or (args.gamma is not None and args.gamma < 1):
        ap.error("--prompts and --gamma must be >= 1, --max-new-tokens >= 2 (a decode step follows the first token)")
    cfg = load_config(overrides={"model": {"torch_threads": 1}})
    gamma = args.gamma or cfg.spec.draft_len
    target, tok, _ = load_target(cfg)
    path = Path(args.drafter) if args.drafter else static_drafter_path(cfg)
    spec = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)
    drafter = load_drafter(path, spec).float().eval()
    served = for_serving(load_drafter(path, spec))
    held = workloads.load_workload(args.workload, "heldout", args.prompts, seed=1)
    res = {m: ModeResult() for m in MODES}
    same = sum(score_prompt(target, drafter, served, render_prompt(tok, p.chat_messages(), 256),
                            args.max_new_tokens, gamma, res) for p in held)
    rows = [("metric", "value"), ("prompts (held-out)", len(held)), ("draft length", gamma),
            ("same text decoded and teacher-forced", f"{same}/{len(held)}")]
    summary = {"workload": args.workload, "drafter": str(path), "prompts": len(held), "gamma": gamma, "same_text": same}
    for m in MODES:
        rows.append((f"{m}: tokens per target forward", f"{res[m].tokens_per_forward:.3f}"))
        summary[m] = res[m].tokens_per_forward
    for m in MODES[1:]:
        lo, hi = ratio_interval(res[m], res["decoded"], "tokens_per_forward")
        ratio = res[m].tokens_per_forward / res["decoded"].tokens_per_forward
        rows.append((f"{m} / decoded", f"{ratio:.3f}x (90% {lo:.3f}-{hi:.3f})"))
        summary[f"{m}_over_decoded"] = [ratio, lo, hi]
    print_table(f"simulated vs decoded acceptance ({args.workload}, {args.max_new_tokens} new tokens/prompt)", rows)
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
