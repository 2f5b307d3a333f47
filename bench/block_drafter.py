"""The block drafter trial: DSpark's semi-autoregressive drafter against the shipped chain drafter.

The block drafter (tide/drafter/block.py) drafts every depth in two layer passes where the chain
drafter runs one per depth. It ships as a drafter kind only if, on held-out chat, it reaches
>= 0.95x the chain drafter's tokens per target forward and >= 1.03x its decode tok/s.

Steps:
1. data: the static recipe's (``--recipe``, default the packaged drafter's): the target's own
   answers to the chat train split, cached in chunks under ``$TIDE_HOME/train-cache/static`` (shared
   with ``tide train --static``; an interrupted run resumes);
2. the block drafter: the recipe's fresh drafter (draft vocab, shapes, init) as a block
   (``BlockDrafter.from_chain``), trained with DSpark's objective (tide/train/block_objective.py)
   at the recipe's compute: one process taking ``train_ranks`` batches per step for ``train_ranks``
   x ``max_train_s`` (the same CPU-seconds and tokens per step as the recipe's ranks). Saved under
   ``$TIDE_HOME/drafters/block-trial-<recipe>`` and reused when trained with the same recipe;
3. held-out simulated acceptance of both drafters (teacher-forced greedy chains, depth ``gamma``);
4. decoding: the demo comparison's held-out chat prompts (seed 11), greedy, the served draft
   length, stop rule and siblings, both drafters as served (``tide.report.compare``, rotated per
   prompt): tokens per target forward and decode tok/s, block over chain with 90% paired bootstrap
   intervals, and the verdict against the two floors.

    python -m bench.block_drafter [--prompts 24] [--max-new-tokens 32] [--rank 64] [--json out.json]
    python -m bench.block_drafter --out /tmp/toy train_prompts=32 max_train_s=20 train_ranks=1 ...  (a toy size)
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench.recipe_variant import recipe_of
from bench.report import print_table, write_json
from tide.comparison import load_prompts
from tide.config import load_config
from tide.drafter.artifact import TargetSpec, load_drafter
from tide.drafter.block import BlockDrafter
from tide.drafter.static import static_drafter_path
from tide.report import compare, ratio_interval
from tide.spec.block import block_draft
from tide.train.block_objective import block_loss
from tide.train.objective import average_chain, chain_lengths
from tide.train.offline import render_prompt
from tide.train.static import RECIPES, StaticRecipe, build_drafter, heldout_chat, training_samples
from tide.train.trainer import collate, prepare, train

CHAT_SEED = 11  # the demo comparison's draw of held-out chat prompts (tide/comparison.py)
FLOORS = {"tokens_per_forward": 0.95, "tokens_per_s": 1.03}  # block over chain, to ship


def trained_block(cfg, recipe: StaticRecipe, rank: int, out: Path, target, tok, eos, source) -> tuple:
    """Steps 1-2: (the block drafter of this recipe, trained now or loaded from ``out``; its
    metadata; the held-out samples)."""
    key = json.loads(json.dumps({"recipe": asdict(recipe), "rank": rank}))
    cache = cfg.home_path / "train-cache" / "static"
    cache.mkdir(parents=True, exist_ok=True)
    samples = training_samples(target, tok, eos, recipe, cache, cfg.home_path, source)
    held = heldout_chat(target, tok, eos, recipe, cache, cfg.home_path, source)
    torch.manual_seed(recipe.seed)
    chain = build_drafter(target, tok, eos, recipe, samples, cfg.home_path)
    meta_path = out / "trial.json"
    if meta_path.exists() and json.loads(meta_path.read_text()).get("key") == key:
        block = BlockDrafter(chain.shape, rank)
        block.load_state_dict(load_file(out / "model.safetensors"))
        return block.eval(), json.loads(meta_path.read_text()), held
    block = BlockDrafter.from_chain(chain, rank, seed=recipe.seed)
    world = recipe.train_ranks  # the recipe's ranks, as batches accumulated per step in one process
    result = train(block, target.embed_weight, target.lm_head_weight, samples, epochs=recipe.epochs, lr=recipe.lr,
                   batch_tokens=recipe.batch_tokens, max_len=recipe.max_len, ttt_length=recipe.gamma,
                   step_weight=0.8, seed=recipe.seed,
                   max_wall_s=recipe.max_train_s * world if recipe.max_train_s else None,
                   precision=recipe.precision, accumulate=world,
                   objective=lambda d, e, h, b: block_loss(d, e, h, b, recipe.gamma))
    meta = {"key": key, "train_s": round(result.wall_s, 1), "train_steps": result.steps,
            "train_tokens": sum(len(s) for s in samples), "train_samples": len(samples),
            "heldout_samples": len(held)}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in block.state_dict().items()}, out / "model.safetensors")
    meta_path.write_text(json.dumps(meta, indent=1))
    return block.eval(), meta, held


def simulated(drafter, target, held, gamma: int, block: bool) -> float:
    """Held-out tokens per forward under teacher forcing (greedy chains of depth ``gamma``)."""
    embed, head = target.embed_weight, target.lm_head_weight
    prepare(held, drafter, head)
    accepted, counted = [], []
    for s in held:
        _, a, c = chain_lengths(drafter, embed, head, collate([s], 10_000), gamma, block=block)
        accepted.append(a)
        counted.append(c)
    return average_chain(torch.cat(accepted), torch.cat(counted), gamma)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="large", choices=sorted(RECIPES))
    ap.add_argument("--rank", type=int, default=64, help="the Markov head's rank")
    ap.add_argument("--out", type=Path, default=None, help="the block drafter's folder (default: under $TIDE_HOME)")
    ap.add_argument("--prompts", type=int, default=24, help="held-out chat prompts decoded")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="recipe fields, key=value (a toy size; the verdict uses none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from tide.models.target import eos_ids_of, load_target
    from tide.train.generation_pool import TargetSource

    cfg = load_config(None)
    recipe, name = recipe_of(args.recipe, args.overrides)
    out = args.out or cfg.home_path / "drafters" / f"block-trial-{name}"
    target, tok, folder = load_target(cfg)
    source = TargetSource(str(folder), target.aux_layer_ids, cfg.model.dtype, cfg.model.max_seq_len)
    t0 = time.monotonic()
    block, meta, held = trained_block(cfg, recipe, args.rank, out, target, tok, eos_ids_of(tok, folder), source)
    spec = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)
    chain = load_drafter(static_drafter_path(cfg), spec)
    gamma = cfg.spec.draft_len
    sim = {"chain": simulated(chain, target, held, gamma, False), "block": simulated(block, target, held, gamma, True)}
    prompts = [render_prompt(tok, p.chat_messages(), 256) for p in load_prompts("chat", "heldout", args.prompts, CHAT_SEED)]
    res = compare(target, {"chain": chain, "block": block}, {"chat": prompts}, args.max_new_tokens, gamma,
                  progress=print, stop_prob=cfg.spec.draft_stop_prob, siblings=cfg.spec.draft_siblings,
                  drafting={"block": block_draft})["chat"]
    ratios = {m: {"ratio": getattr(res["block"], m) / getattr(res["chain"], m),
                  "interval_90": ratio_interval(res["block"], res["chain"], m)} for m in FLOORS}
    verdict = "ship" if all(ratios[m]["ratio"] >= f for m, f in FLOORS.items()) else "do not ship"
    report = {"recipe": name, "block": str(out), "chain": str(static_drafter_path(cfg)), "trial": meta,
              "simulated_tokens_per_forward": sim, "modes": {m: r.as_dict() for m, r in res.items()},
              "block_over_chain": ratios, "floors": FLOORS, "verdict": verdict,
              "wall_s": round(time.monotonic() - t0, 1)}
    rows = [("mode", "sim tokens/forward", "tokens/forward", "tok/s", "identical to target")]
    rows += [(m, f"{sim.get(m, 1.0):.3f}", f"{r.tokens_per_forward:.3f}", f"{r.tokens_per_s:.2f}",
              f"{r.identical_to_target}/{r.prompts}") for m, r in res.items()]
    rows += [("block/chain", "", *(f"{ratios[m]['ratio']:.3f} ({ratios[m]['interval_90'][0]:.3f}-"
                                   f"{ratios[m]['interval_90'][1]:.3f})" for m in FLOORS), "")]
    print_table(f"held-out chat: {len(prompts)} prompts x {args.max_new_tokens} tokens; verdict: {verdict}", rows)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
