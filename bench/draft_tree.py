"""How far a small draft tree would lift a drafter: simulated tokens per target forward of
"chain + siblings" trees on held-out self-generated answers, beside the chain.

A tree shape ``k1,k2,...`` drafts the top-``k_d`` tokens at depth d, and only the top-1 token of a
depth has children (so ``1,1,1,1`` is today's chain of 4, and the tree has ``sum(k)`` nodes, its
verify ``sum(k) + 1`` query rows). Under greedy verification the walk accepts depth d when the
target's token there is among the ``k_d`` drafts and every earlier depth's target token was the
drafter's top 1 (a sibling has no children). Teacher-forced on the target's own greedy answers,
exactly as ``simulated_acceptance`` scores the chain; an EAGLE-2-style dynamic tree of the same
size does at least as well, so these are floors on what a tree of that size gets.

The reference engine verifies up to 6 query rows in one pass over the weights (docs/benchmarks.md,
"Verify cost by query tokens"), so shapes of up to 5 nodes cost about what the chain costs to verify.

    python -m bench.draft_tree [--drafter DIR] [--shapes 1,1,1,1 2,1,1,1 3,2,1,1]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from bench.static_levers import HELDOUT, heldout_prompts, interval90
from tide.config import load_config
from tide.models.target import eos_ids_of, load_target
from tide.train.objective import needed_rows, unroll
from tide.train.static import SELF_GENERATED_RECIPE, prompt_samples
from tide.train.trainer import collate, prepare

SHAPES = ("1,1,1,1", "2,1,1,1", "3,1,1,1", "2,2,1,1", "3,2,1,1", "4,2,1,1", "3,2,2,1", "4,3,2,1", "8,4,2,1")


@torch.no_grad()
def target_ranks(drafter, embed: torch.Tensor, lm_head: torch.Tensor, sample, depth: int) -> tuple[torch.Tensor, ...]:
    """(ranks [n, depth], counted [n, depth], top [n, depth]): the rank of the target's greedy token
    among the drafter's draft-vocab logits at each depth of the teacher-forced chain from each
    generated position (a token outside the draft vocab ranks past every draft); ``counted``: that
    depth's token is generated (not past the answer's end); ``top``: the drafter's own top
    probability there (what the engine's live signal multiplies)."""
    prepare([sample], drafter, lm_head)
    batch = collate([sample], len(sample))
    rows = needed_rows(batch.loss_mask, 1)
    base = rows.at(batch.loss_mask, 0) > 0
    vd = drafter.d2t.shape[0]
    draft_of = torch.full((drafter.t2d.shape[0],), -1, dtype=torch.long)
    draft_of[torch.arange(vd) + drafter.d2t] = torch.arange(vd)  # target id -> draft id
    ranks, counted, tops = [], [], []
    for step, logits, _ in unroll(drafter, embed, batch, depth, rows=rows):
        tops.append(torch.softmax(logits.float(), dim=-1).amax(-1))
        top = rows.at(batch.target_top, step)
        d = draft_of[top]
        own = logits.gather(1, d.clamp(min=0)[:, None])
        rank = (logits > own).sum(-1)
        ranks.append(torch.where(d >= 0, rank, torch.full_like(rank, vd)))
        counted.append(rows.at(batch.loss_mask, step) > 0)
    return torch.stack(ranks, 1)[base], torch.stack(counted, 1)[base], torch.stack(tops, 1)[base]


def tokens_per_forward(ranks: torch.Tensor, counted: torch.Tensor, shape: tuple[int, ...]) -> float:
    """Mean 1 + accepted depths of one sibling tree over the positions."""
    top1_so_far = torch.ones(ranks.shape[0], dtype=torch.bool)
    accepted = torch.zeros(ranks.shape[0])
    for d, k in enumerate(shape):
        accepted += (top1_so_far & (ranks[:, d] < k) & counted[:, d]).float()
        top1_so_far &= (ranks[:, d] == 0) & counted[:, d]
    return 1.0 + float(accepted.mean())


def main(argv=None) -> int:
    from tide.drafter.artifact import TargetSpec, load_drafter
    from tide.drafter.static import static_drafter_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", type=Path, default=None, help="a drafter folder (default: the static one)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--heldout", type=int, default=24)
    p.add_argument("--kinds", nargs="+", default=list(HELDOUT), choices=HELDOUT)
    p.add_argument("--cache", type=Path, default=Path("/tmp/tide-static-levers"),
                   help="held-out answers (shared with bench/static_levers.py; generated when missing)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config()
    target, tokenizer, folder = load_target(cfg)
    eos = eos_ids_of(tokenizer, folder)
    path = args.drafter or static_drafter_path(cfg)
    drafter = load_drafter(path, TargetSpec(target.shape.hidden_size, target.shape.vocab_size,
                                            target.aux_layer_ids)).float().eval()
    shapes = [tuple(int(k) for k in s.split(",")) for s in args.shapes]
    depth = max(len(s) for s in shapes)
    recipe = replace(SELF_GENERATED_RECIPE, heldout_prompts=args.heldout)
    out = {"drafter": str(path), "rows": []}
    print(f"drafter {path}; held-out self-generated answers, {args.heldout} per workload; 90% bootstrap over prompts")
    print("| workload | tree (top-k by depth) | nodes | verify rows | tokens per forward | over the chain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind in args.kinds:
        held = prompt_samples(target, tokenizer, eos, heldout_prompts(kind, args.heldout, recipe.seed, cfg.home_path),
                              recipe, args.cache, f"heldout-{kind}-{args.heldout}x{recipe.max_new_tokens}", False)
        per = [target_ranks(drafter, target.embed_weight, target.lm_head_weight, s, depth) for s in held]
        ranks, counted = torch.cat([r for r, _, _ in per]), torch.cat([c for _, c, _ in per])
        chain = tokens_per_forward(ranks, counted, (1,) * depth)
        for shape in shapes:
            pooled = tokens_per_forward(ranks, counted, shape)
            prompts = [tokens_per_forward(r, c, shape) for r, c, _ in per]
            lo, hi = interval90(prompts)
            row = {"kind": kind, "shape": list(shape), "nodes": sum(shape), "tokens_per_forward": round(pooled, 4),
                   "interval90": [round(lo, 4), round(hi, 4)], "over_chain": round(pooled / chain, 4)}
            out["rows"].append(row)
            print(f"| {kind} | {','.join(map(str, shape))} | {sum(shape)} | {sum(shape) + 1} | "
                  f"{pooled:.3f} [{lo:.2f}, {hi:.2f}] | {pooled / chain:.3f}x |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
