"""How much DSpark's admission (every (request, position) candidate ranked, verified packed) can gain
over one draft depth for the whole batch (the cost scheduler) on one drafter and this machine's
measured step costs, with timing noise, the rounds' tails and the decision to draft taken out.

Held-out self-generated answers, teacher-forced (bench/draft_tree.py), give every generated
position its accepted run (the leading drafts equal to the target's greedy tokens, up to gamma)
and the drafter's top probability at each depth. A step is B positions drawn from B different
answers. Both rules see the same live signal for every depth, as if the drafter had run them all:
the top-probability chain scaled per depth by observed accepts over predicted ones (as the
engine's tracker scales it), and each verifies what its rule picks from it:
- level (``cost``): the depth m with the most expected tokens per second, every row padded to m;
- admission (``dspark``): ``tide.spec.admission.admit`` over every (row, depth) candidate, packed.
A step scores what it really commits (B + each row's accepted drafts among those verified) over
its seconds in the measured table (that verify, packed where rows' lengths differ, plus the drafter
to the deepest verified depth). The ratio admission / level is the gain the admission can bring on
this signal; the live engines also decide before drafting, stop the drafter early and pay per-step
overheads. The table is profiled at start, or read from an earlier run's JSON (``--costs``): the
profile's own noise moves the ratio more than its interval over steps says.

    python -m bench.admission_headroom [--drafter DIR] [--batch 1,2,4,8] [--kinds chat code] [--json PATH]
        [--costs EARLIER_JSON]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from bench.draft_tree import target_ranks
from bench.report import write_json
from bench.static_levers import heldout_prompts
from tide.config import load_config
from tide.drafter.artifact import TargetSpec, load_drafter
from tide.drafter.model import for_serving
from tide.drafter.static import static_drafter_path
from tide.models.target import eos_ids_of, load_target
from tide.spec.admission import admit
from tide.spec.cost import StepCostModel, profile
from tide.spec.schedule import best_level
from tide.train.static import SELF_GENERATED_RECIPE, prompt_samples

GAMMA = 4  # the engine's default draft_len


def signal(per: list[tuple[torch.Tensor, ...]]) -> dict:
    """Pooled positions: ``run`` [n] accepted drafts, ``cap`` [n] depths before the answer's end,
    ``survival`` [n, GAMMA] the calibrated prefix survival, ``answer`` [n] each position's answer."""
    ranks, counted, top = (torch.cat([p[i] for p in per]) for i in range(3))
    answer = torch.cat([torch.full((p[0].shape[0],), a) for a, p in enumerate(per)])
    run = ((ranks == 0) & counted).long().cumprod(1).sum(1)
    chain = top.float().cumprod(1)  # the engine's live signal without a head
    scale = torch.stack([(run[counted[:, j]] > j).float().sum() / chain[counted[:, j], j].sum()
                         for j in range(GAMMA)])
    survival = torch.cummin((chain * scale).clamp(max=1.0), dim=1).values  # P never rises with depth
    return {"run": run, "cap": counted.long().sum(1), "survival": survival, "answer": answer, "scale": scale}


def draw_steps(sig: dict, rows: int, steps: int, seed: int) -> torch.Tensor:
    """[steps, rows] position indices, each step's rows from distinct answers."""
    g = torch.Generator().manual_seed(seed)
    by_answer = [torch.nonzero(sig["answer"] == a).flatten() for a in range(int(sig["answer"].max()) + 1)]
    out = torch.empty(steps, rows, dtype=torch.long)
    for s in range(steps):
        for b, a in enumerate(torch.randperm(len(by_answer), generator=g)[:rows].tolist()):
            pos = by_answer[a]
            out[s, b] = pos[int(torch.randint(len(pos), (), generator=g))]
    return out


def score(sig: dict, picks: torch.Tensor, table: dict, rows: int) -> dict:
    """Per step (committed tokens, seconds) of the level and of the admission."""
    verify = [v / 1e3 for v in table["verify_ms"][rows]]  # [m]: rows x (1 + m) tokens, padded
    draft = [0.0] + [v / 1e3 for v in table["draft_ms"][rows]]  # [d]: the drafter to depth d
    packed = [v / 1e3 for v in table["packed_verify_ms"][rows]]  # [k]: k drafts in all, packed
    level_s = [verify[m] + draft[m] for m in range(GAMMA + 1)]
    out = {k: torch.zeros(len(picks)) for k in ("level_tokens", "level_s", "admit_tokens", "admit_s",
                                                  "level_drafts", "admit_drafts")}
    for s, idx in enumerate(picks.tolist()):
        surv = sig["survival"][idx].tolist()
        runs, caps = sig["run"][idx].tolist(), [min(GAMMA, c) for c in sig["cap"][idx].tolist()]
        sums = [sum(p[j] for p, c in zip(surv, caps) if c > j) for j in range(GAMMA)]
        m = best_level(sums, rows, level_s)
        kept = [min(m, c) for c in caps]
        lengths, _, _ = admit(surv, caps, lambda k, ran, even: (verify[even] if even else packed[k]) + draft[ran])
        out["level_tokens"][s] = rows + sum(min(r, k) for r, k in zip(runs, kept))
        out["level_s"][s] = level_s[m]
        out["admit_tokens"][s] = rows + sum(min(r, k) for r, k in zip(runs, lengths))
        # rows of one length verify unpacked (tide/spec/decode.py verify): the padded cell is that forward
        verified = verify[lengths[0]] if min(lengths) == max(lengths) else packed[sum(lengths)]
        out["admit_s"][s] = verified + draft[max(lengths)]
        out["level_drafts"][s], out["admit_drafts"][s] = sum(kept), sum(lengths)
    out["target_rate"] = rows / verify[0]
    return out


def rate_ratio_interval(num_tok, num_s, den_tok, den_s, draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(ratio of tokens/s, its 90% bootstrap interval over steps)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(num_tok), (draws, len(num_tok)), generator=g)
    boot = (num_tok[idx].sum(1) / num_s[idx].sum(1)) / (den_tok[idx].sum(1) / den_s[idx].sum(1))
    point = float((num_tok.sum() / num_s.sum()) / (den_tok.sum() / den_s.sum()))
    return point, float(boot.quantile(0.05)), float(boot.quantile(0.95))


def step_costs(target, drafter, max_rows: int, context_len: int = 128) -> dict:
    """This machine's step costs as the engine profiles them at start-up, both grids in one model:
    the padded verify (the cost scheduler's) and the packed one (the admission's)."""
    cost, served = StepCostModel(max_rows, GAMMA), for_serving(drafter)
    length = context_len + 2 * GAMMA + 2
    for packed in (False, True):
        profile(target, served, target.new_cache(max_rows, length), served.new_cache(max_rows, length), cost,
                context_len, packed=packed)
    return {k: {int(r): v for r, v in cells.items()} for k, cells in cost.table().items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", type=Path, default=None, help="a drafter folder (default: the static one)")
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--kinds", nargs="+", default=["chat", "code"], choices=["chat", "code", "korean"])
    p.add_argument("--heldout", type=int, default=24)
    p.add_argument("--steps", type=int, default=3000, help="drawn steps per cell")
    p.add_argument("--cache", type=Path, default=Path("/tmp/tide-static-levers"),
                   help="held-out answers (shared with bench/static_levers.py; generated when missing)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--costs", type=Path, default=None,
                   help="score over the step costs of an earlier run's --json (default: profile them now): "
                        "rules compared across runs on one table, the profile's own noise taken out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batch.split(",")]
    if min(batches) < 1 or max(batches) > args.heldout:  # a step's rows come from distinct answers
        p.error(f"--batch must be 1..--heldout ({args.heldout}), got {args.batch}")
    cfg = load_config()
    target, tokenizer, folder = load_target(cfg)
    path = args.drafter or static_drafter_path(cfg)
    spec = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)
    if args.costs is not None:
        try:
            saved = json.loads(args.costs.read_text())["step_cost"]
            table = {kind: {int(r): v for r, v in cells.items()} for kind, cells in saved.items()}
            rows_held = max(table["packed_verify_ms"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            p.error(f"--costs {args.costs}: not an earlier run's --json with its step costs ({exc!r})")
        if max(batches) > rows_held:
            p.error(f"--costs {args.costs} holds step costs up to {rows_held} rows")
    else:
        table = step_costs(target, load_drafter(path, spec), max(batches))  # as the engine serves it
    drafter = load_drafter(path, spec).float().eval()
    recipe = replace(SELF_GENERATED_RECIPE, heldout_prompts=args.heldout)
    args.cache.mkdir(parents=True, exist_ok=True)
    out, rows_out = {"drafter": str(path), "steps": args.steps, "step_cost": table, "cells": []}, []
    for kind in args.kinds:
        held = prompt_samples(target, tokenizer, eos_ids_of(tokenizer, folder),
                              heldout_prompts(kind, args.heldout, recipe.seed, cfg.home_path), recipe, args.cache,
                              f"heldout-{kind}-{args.heldout}x{recipe.max_new_tokens}", False)
        sig = signal([target_ranks(drafter, target.embed_weight, target.lm_head_weight, s, GAMMA) for s in held])
        for rows in batches:
            r = score(sig, draw_steps(sig, rows, args.steps, seed=rows), table, rows)
            adm = rate_ratio_interval(r["admit_tokens"], r["admit_s"], r["level_tokens"], r["level_s"])
            cell = {"kind": kind, "rows": rows, "admission_over_level": [round(v, 4) for v in adm],
                    "level_over_target": round(float(r["level_tokens"].sum() / r["level_s"].sum()) / r["target_rate"], 4),
                    "admission_over_target": round(float(r["admit_tokens"].sum() / r["admit_s"].sum())
                                                   / r["target_rate"], 4),
                    "drafts_per_step": [round(float(r["level_drafts"].mean()), 2),
                                        round(float(r["admit_drafts"].mean()), 2)],
                    "calibration_scale": [round(v, 3) for v in sig["scale"].tolist()]}
            out["cells"].append(cell)
            rows_out.append((kind, str(rows), f"{cell['level_over_target']:.3f}", f"{cell['admission_over_target']:.3f}",
                             f"{adm[0]:.3f} ({adm[1]:.3f}-{adm[2]:.3f})",
                             f"{cell['drafts_per_step'][0]} / {cell['drafts_per_step'][1]}"))
            print(rows_out[-1], flush=True)
    print(f"\ndrafter {path}; {args.steps} drawn steps per cell; 90% bootstrap over steps")
    print("| workload | B | level / target-only | admission / target-only | admission / level | "
          "drafts verified per step (level / admission) |\n|---|---|---|---|---|---|")
    for row in rows_out:
        print("| " + " | ".join(row) + " |")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
