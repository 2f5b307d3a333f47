"""The in-domain reference: how much of the possible gain one retrain recovers after a shift.

A drafter trained offline for the new traffic, the code workload, with the static recipe's method
and compute (``tide/train/static.py``, ``--recipe large`` by default: the target answers the
training split's prompts itself, the draft vocab comes from ShareGPT text plus those answers, a
fresh drafter trains on the recipe's ranks, batches, precision and wall-time cap, and gets its
confidence head), is compared on held-out code with the static drafter and an adapted one (a
demo's registered version, ``--adapted``). The code workload's training split holds 3636
prompts, fewer than the chat recipe's 5600: generation then costs less, and the training half
(the wall cap) the same.

Steps:
1. the reference: ``$TIDE_HOME/drafters/in-domain-code-<recipe>`` when it was trained with this
   recipe, else trained (answers cached in chunks under ``$TIDE_HOME/train-cache/in-domain-code``:
   an interrupted run resumes, and never in CI: the large recipe takes ~1.4 h and ~2.4 CPU-hours
   here);
2. the comparison (``tide.report.compare``, as the demo's): the demo's held-out code prompts (seed
   13), greedy, the served draft length, stop rule and siblings, every drafter on every prompt;
   tokens per target forward and decode tok/s of each, and each ratio with its 90% paired
   bootstrap interval over prompts. The figure: adapted / in-domain.

3. ``--curve N:passes,...`` (what closes the gap): the static drafter retrained as an online retrain
   trains it (``train.*`` defaults: rate, batches, TTT, update fraction) on the first N requests of
   the code training split for a fixed number of passes (steps, not seconds: the figure does not
   depend on the machine's load), each compared with the reference the same way. N=150 at 8 passes
   is about what the demo's full retrain sees (its 32k-token window, ~8 passes capped by time);
   ``--curve-fractions 1,0.6`` scores each at those update fractions (one training run each).

    python -m bench.in_domain --adapted <folder of a demo's adapted version> [--prompts 24] [--json out.json]
    python -m bench.in_domain --curve 150:8,1200:1 --json curve.json
    python -m bench.in_domain --out /tmp/toy train_prompts=32 max_train_s=20 train_ranks=1 ...  (a toy size)
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.recipe_variant import recipe_of
from bench.report import print_table, write_json
from tide.comparison import load_prompts
from tide.config import load_config
from tide.config import replace as config_replace
from tide.drafter.artifact import TargetSpec, load_drafter, save_drafter
from tide.drafter.static import static_drafter_path
from tide.report import compare, ratio_interval
from tide.train.offline import render_prompt
from tide.train.static import RECIPES, StaticRecipe, build_drafter, fit, generation_chunks, prompt_samples

WORKLOAD = "code"
COMPARE_SEED = 13  # the demo comparison's draw of held-out code prompts (tide/comparison.py)


def reference_folder(home: Path, recipe_name: str) -> Path:
    return home / "drafters" / f"in-domain-{WORKLOAD}-{recipe_name}"


def is_trained(folder: Path, recipe: StaticRecipe) -> bool:
    """A reference trained with exactly this recipe (its tide.json says so)."""
    try:
        meta = json.loads((folder / "tide.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("metadata", meta).get("recipe") == json.loads(json.dumps(asdict(recipe)))


def train_reference(cfg, recipe: StaticRecipe, out: Path, cache: Path) -> dict:
    """The static recipe on the code workload's training split (step 1); returns its metadata."""
    from tide import workloads
    from tide.drafter.confidence import frozen
    from tide.models.target import eos_ids_of, load_target
    from tide.train.confidence import fit_confidence
    from tide.train.generation_pool import TargetSource

    torch.manual_seed(recipe.seed)
    target, tok, folder = load_target(cfg)
    eos, home = eos_ids_of(tok, folder), cfg.home_path
    cache.mkdir(parents=True, exist_ok=True)
    source = TargetSource(str(folder), target.aux_layer_ids, cfg.model.dtype, cfg.model.max_seq_len)
    t0 = time.monotonic()
    prompts = workloads.code("train", recipe.train_prompts, recipe.seed, home=home)
    samples = []
    for a, b in generation_chunks(len(prompts), recipe.generation_chunk):
        samples += prompt_samples(target, tok, eos, prompts[a:b], recipe, cache,
                                  f"train-{a}-{b}x{recipe.max_new_tokens}", recipe.train_on_prompt, source=source)
    held = prompt_samples(target, tok, eos, workloads.code("heldout", recipe.heldout_prompts, recipe.seed, home=home),
                          recipe, cache, f"heldout-{recipe.heldout_prompts}x{recipe.max_new_tokens}", False,
                          source=source)
    generation_s = time.monotonic() - t0
    drafter = build_drafter(target, tok, eos, recipe, samples, home)
    result, _, after = fit(drafter, target, samples, held, recipe, scratch_dir=cache)
    confidence = {}
    if recipe.confidence_head:
        head, confidence = fit_confidence(drafter, target.embed_weight, target.lm_head_weight, samples, held,
                                          depth=recipe.gamma, batch_tokens=recipe.batch_tokens, seed=recipe.seed)
        drafter.confidence = frozen(head)
    meta = {"version": f"in-domain-{WORKLOAD}", "workload": WORKLOAD, "recipe": asdict(recipe),
            "train_prompts": len(prompts), "train_tokens": sum(len(s) for s in samples),
            "loss_tokens": int(sum(float(s.loss_mask.sum()) for s in samples)),
            "generation_s": round(generation_s, 1), "train_s": round(result.wall_s, 1), "train_steps": result.steps,
            "heldout_sim_accept_length": round(after.accept_length, 4),
            "heldout_replayed_accept_length": round(after.replayed_accept_length, 4),
            "target": cfg.model.model_id, "confidence": confidence}
    save_drafter(drafter, out, metadata=meta, dtype=torch.bfloat16)
    return meta


def ratios(res: dict, a: str, b: str) -> dict:
    """``a`` over ``b`` in tokens per forward and tok/s, each with its 90% interval."""
    return {m: {"ratio": getattr(res[a], m) / getattr(res[b], m), "interval_90": ratio_interval(res[a], res[b], m)}
            for m in ("tokens_per_forward", "tokens_per_s")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapted", type=Path, default=None, help="an adapted drafter folder (a demo's registered version)")
    ap.add_argument("--recipe", default="large", choices=sorted(RECIPES))
    ap.add_argument("--out", type=Path, default=None, help="the reference's folder (default: under $TIDE_HOME/drafters)")
    ap.add_argument("--prompts", type=int, default=24, help="held-out code prompts compared")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--curve", default="", help="N:passes,... retrains from the static drafter on the first N "
                                                 "code training requests (step 3)")
    ap.add_argument("--curve-fractions", default="", help="update fractions each curve retrain is scored at "
                                                           "(default: train.update_fraction)")
    ap.add_argument("overrides", nargs="*", help="recipe fields, key=value (a toy size; the figure uses none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = load_config(None)
    recipe, name = recipe_of(args.recipe, args.overrides)
    out = args.out or reference_folder(cfg.home_path, name)
    if is_trained(out, recipe):
        print(f"in-domain reference: {out} (trained before with this recipe)")
    else:
        meta = train_reference(cfg, recipe, out, cfg.home_path / "train-cache" / f"in-domain-{WORKLOAD}")
        print(f"in-domain reference trained: {out}\n" + json.dumps({k: v for k, v in meta.items() if k != "recipe"}))
    return report(cfg, out, args, recipe)


def curve_points(text: str) -> list[tuple[int, int]]:
    """"150:8,1200:1" -> [(150, 8), (1200, 1)]: requests and passes, each >= 1."""
    points = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        n, _, passes = item.partition(":")
        if not (n.isdigit() and passes.isdigit() and int(n) > 0 and int(passes) > 0):
            raise SystemExit(f"--curve: {item!r} is not N:passes with both >= 1")
        points.append((int(n), int(passes)))
    return points


def curve_drafters(cfg, recipe: StaticRecipe, points: list[tuple[int, int]], target, tok, eos, static,
                   fractions: tuple[float, ...] = ()) -> dict:
    """Step 3: {"retrain-N-xP": the static drafter retrained on the first N code training requests
    for P passes, at the retrain's update fraction (or "retrain-N-xP-fF" at each of ``fractions``),
    rounded to bf16 as registered}."""
    import copy

    from tide import workloads
    from tide.drafter.artifact import round_weights_
    from tide.train.fraction import keep_update_
    from tide.train.ranks import train_kwargs
    from tide.train.trainer import train

    if not points:
        return {}
    cache = cfg.home_path / "train-cache" / f"in-domain-{WORKLOAD}"
    # the reference's prompts and cached chunks: only those holding the first N are read
    prompts = workloads.code("train", recipe.train_prompts, recipe.seed, home=cfg.home_path)
    samples = []
    for a, b in generation_chunks(len(prompts), recipe.generation_chunk):
        if a >= max(n for n, _ in points):
            break
        samples += prompt_samples(target, tok, eos, prompts[a:b], recipe, cache,
                                  f"train-{a}-{b}x{recipe.max_new_tokens}", recipe.train_on_prompt)
    out = {}
    for n, passes in points:
        tc = config_replace(cfg.train, epochs=passes, max_train_s=1e9)  # passes decide, not the clock
        cand = copy.deepcopy(static)
        t0 = time.monotonic()
        result = train(cand, target.embed_weight, target.lm_head_weight, samples[:n], **train_kwargs(tc))
        for fraction in fractions or (tc.update_fraction,):  # each: the change kept, as a retrain registers it
            kept = copy.deepcopy(cand)
            keep_update_(kept, static, fraction)
            out[f"retrain-{n}-x{passes}" + (f"-f{fraction:g}" if fractions else "")] = round_weights_(kept, torch.bfloat16)
        print(f"retrain on {n} code requests x {passes} passes: {result.steps} steps in "
              f"{time.monotonic() - t0:.0f} s, {sum(len(s) for s in samples[:n])} tokens")
    return out


def report(cfg, reference: Path, args, recipe: StaticRecipe) -> int:
    """Step 2 (and 3): static, adapted, in-domain and the curve's retrains on the same held-out code prompts."""
    from tide.models.target import eos_ids_of, load_target

    target, tok, folder = load_target(cfg)
    spec = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)
    drafters = {"static": load_drafter(static_drafter_path(cfg), spec), "in_domain": load_drafter(reference, spec)}
    if args.adapted is not None:
        drafters["adapted"] = load_drafter(args.adapted, spec)
    fractions = tuple(float(f) for f in args.curve_fractions.split(",") if f.strip())
    drafters.update(curve_drafters(cfg, recipe, curve_points(args.curve), target, tok, eos_ids_of(tok, folder),
                                   drafters["static"], fractions))
    prompts = [render_prompt(tok, p.chat_messages(), 256)
               for p in load_prompts(WORKLOAD, "heldout", args.prompts, COMPARE_SEED)]
    res = compare(target, drafters, {WORKLOAD: prompts}, args.max_new_tokens, cfg.spec.draft_len, progress=print,
                  stop_prob=cfg.spec.draft_stop_prob, siblings=cfg.spec.draft_siblings)[WORKLOAD]
    out = {"reference": str(reference), "adapted": str(args.adapted) if args.adapted else None,
           "prompts": len(prompts), "modes": {m: r.as_dict() for m, r in res.items()},
           "ratios": {f"{a}_over_{b}": ratios(res, a, b)
                      for a, b in (("adapted", "in_domain"), ("static", "in_domain"), ("adapted", "static"),
                                   *((m, "in_domain") for m in res if m.startswith("retrain-")))
                      if a in res and b in res}}
    rows = [("mode", "tokens/forward", "tok/s", "identical to target")]
    rows += [(m, f"{r.tokens_per_forward:.3f}", f"{r.tokens_per_s:.2f}", f"{r.identical_to_target}/{r.prompts}")
             for m, r in res.items()]
    rows += [(k, *(f"{v[m]['ratio']:.3f} ({v[m]['interval_90'][0]:.3f}-{v[m]['interval_90'][1]:.3f})"
                   for m in ("tokens_per_forward", "tokens_per_s")), "") for k, v in out["ratios"].items()]
    print_table(f"held-out {WORKLOAD}: {len(prompts)} prompts x {args.max_new_tokens} tokens", rows)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
