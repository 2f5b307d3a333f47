"""Calibration of the draft confidence head on real traffic, one run per workload.

The target answers workload prompts greedily (its states at every position, as capture records
them); the head is fitted on the train-split answers, its per-depth temperatures on half of the
held-out answers, and expected calibration error (ECE) is measured on the other half for three
survival estimates: the draft's raw top probability (today's stop rule), the head before scaling
and after. The 90% interval resamples held-out requests (rows within one request correlate).

    python -m bench.confidence [--workload chat] [--train-prompts 96] [--heldout-prompts 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import random
import sys

import torch

from bench.report import print_table, write_json
from tide import workloads
from tide.config import load_config
from tide.drafter.artifact import TargetSpec, load_drafter
from tide.drafter.confidence import ConfidenceHead
from tide.drafter.static import static_drafter_path
from tide.models.target import eos_ids_of, load_target
from tide.train.confidence import _features_of, alive_ece, calibration_error, fit_head, fit_temperatures
from tide.train.offline import generate_samples, render_prompt


def answers(target, tok, eos, workload: str, split: str, n: int, max_new_tokens: int, seed: int):
    prompts = workloads.load_workload(workload, split, n, seed=seed)
    ids = [render_prompt(tok, p.chat_messages(), 192) for p in prompts]
    return generate_samples(target, ids, max_new_tokens, eos, batch_size=16, progress=False)


def interval_over_requests(head, test, reps: int = 400, seed: int = 0) -> tuple[float, float]:
    """90% bootstrap interval of the scaled head's ECE, resampling held-out requests."""
    rng = random.Random(seed)
    groups = sorted(set(test.group.tolist()))
    by_group = {g: (test.group == g).nonzero().flatten() for g in groups}
    with torch.no_grad():
        p = head.survival(test.x, test.depth)
    values = []
    for _ in range(reps):
        idx = torch.cat([by_group[rng.choice(groups)] for _ in groups])
        idx = idx[test.alive[idx]]
        values.append(calibration_error(p[idx], test.label[idx]))
    values.sort()
    return values[int(0.05 * reps)], values[int(0.95 * reps) - 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--train-prompts", type=int, default=96)
    ap.add_argument("--heldout-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--l2", type=float, default=1e-3, help="the head's L2 penalty")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config()
    target, tok, folder = load_target(cfg)
    eos = eos_ids_of(tok, folder)
    drafter = load_drafter(args.drafter or static_drafter_path(cfg),
                           TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)).float()
    embed, lm_head = target.embed_weight, target.lm_head_weight
    train = answers(target, tok, eos, args.workload, "train", args.train_prompts, args.max_new_tokens, 0)
    held = answers(target, tok, eos, args.workload, "heldout", args.heldout_prompts, args.max_new_tokens, 1)
    feats = lambda samples: _features_of(drafter, embed, lm_head, samples, args.depth, 65536, 4096, 1024, 0)
    head = ConfidenceHead(drafter.shape.hidden_size, args.depth)
    bce = fit_head(head, feats(train), l2=args.l2)
    calib, test = feats(held[0::2]), feats(held[1::2])
    raw = alive_ece(head, test, raw=True)
    top = calibration_error(test.x[test.alive, -1].exp(), test.label[test.alive])
    temps = fit_temperatures(head, calib)
    scaled = alive_ece(head, test)
    lo, hi = interval_over_requests(head, test)
    summary = {"workload": args.workload, "train_requests": len(train), "heldout_requests": len(held),
               "test_rows": int(test.alive.sum()), "ece_top_prob": top, "ece_head_raw": raw, "ece_head_scaled": scaled,
               "ece_scaled_interval_90": [lo, hi], "temperatures": temps, "train_bce": bce}
    print_table(f"draft confidence calibration ({args.workload}, depth {args.depth})", [
        ("metric", "value"), ("requests: train / held-out", f"{len(train)} / {len(held)}"),
        ("held-out rows scored (chains alive)", summary["test_rows"]),
        ("ECE, raw draft top probability", f"{top:.4f}"), ("ECE, head before scaling", f"{raw:.4f}"),
        ("ECE, head after sequential scaling", f"{scaled:.4f}"),
        ("  90% interval over requests", f"{lo:.4f} - {hi:.4f}"),
        ("temperatures by depth", " ".join(f"{t:.2f}" for t in temps))])
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
