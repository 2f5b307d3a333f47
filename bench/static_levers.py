"""Static-drafter levers at equal compute: target init and teacher-forced data, alone and together.

Two stages, so levers can run as separate processes (one core each):
- ``data``: build and cache every data set once, timed (wall and process CPU): the self-generated
  share (the target answers train prompts), the teacher-forced share (the target prefilled over
  ShareGPT replies) and held-out self-generated answers for chat, code and Korean; prints tokens
  per CPU-minute of both training paths;
- ``run LEVER``: one drafter trained under the same wall-time cap (``--train-s``) on its data,
  evaluated (simulated accept length at gamma) on the three held-out sets; one JSON per lever.
- ``packaged``: the packaged static drafter (``make static-drafter``, the full recipe's compute)
  evaluated on the same held-out sets, so a lever run at the recipe's compute has its baseline;
  with ``--drafter DIR --name NAME`` any drafter artifact (a ``tide train --static --recipe`` run),
  as row NAME;
``table`` prints every lever's row side by side with the baseline's ratio.

    python -m bench.static_levers data --gen-prompts 240 --teacher 300
    python -m bench.static_levers run init+teacher --train-s 420
    python -m bench.static_levers packaged
    python -m bench.static_levers packaged --drafter /tmp/scaled/drafter --name scaled
    python -m bench.static_levers table
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from tide import workloads
from tide.config import load_config
from tide.drafter.artifact import save_drafter
from tide.models.target import eos_ids_of, load_target
from tide.train.static import SELF_GENERATED_RECIPE, StaticRecipe, build_drafter, fit, prompt_samples, training_samples
from tide.train.trainer import evaluate

# lever -> (self-generated share on, teacher-forced share on, recipe fields); intermediate_size
# None is the target's width, so target init copies the whole MLP
INIT = {"init_from_target": True, "intermediate_size": None}
LEVERS = {
    "baseline": (True, False, {}),
    "init": (True, False, INIT),
    "init-mlp1024": (True, False, {"init_from_target": True}),
    "init-lr5e-4": (True, False, {**INIT, "lr": 5e-4}),
    "teacher": (False, True, {}),
    "init+teacher": (False, True, INIT),
    "teacher+gen": (True, True, {}),
    "init+teacher+gen": (True, True, INIT),
    # a larger draft vocab covers more of the target's greedy tokens (``<kind>_coverage``) at the
    # cost of a wider drafter lm_head, in training and at every draft step
    "vocab16k": (True, False, {"draft_vocab_size": 16384}),
    "vocab32k": (True, False, {"draft_vocab_size": 32768}),
    "init+vocab16k": (True, False, {**INIT, "draft_vocab_size": 16384}),
}
HELDOUT = ("chat", "code", "korean")


def heldout_prompts(kind: str, n: int, seed: int, home: Path):
    return workloads.load_workload(kind, "heldout", n, seed, home=home)


def recipe_of(args, lever: str) -> StaticRecipe:
    gen, teacher, fields = LEVERS[lever]
    return replace(SELF_GENERATED_RECIPE, train_prompts=args.gen_prompts if gen else 0,
                   teacher_conversations=args.teacher if teacher else 0, **fields,
                   epochs=1000, max_train_s=args.train_s, heldout_prompts=args.heldout)


def stage_data(args, parts) -> None:
    target, tokenizer, eos, home, cache = parts
    base = replace(SELF_GENERATED_RECIPE, heldout_prompts=args.heldout)
    rows = {}
    for name, recipe in (("self-generated", replace(base, train_prompts=args.gen_prompts)),
                         ("teacher-forced", replace(base, train_prompts=0, teacher_conversations=args.teacher))):
        wall, cpu = time.monotonic(), time.process_time()
        samples = training_samples(target, tokenizer, eos, recipe, cache, home)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        loss_tokens = int(sum(float(s.loss_mask.sum()) for s in samples))
        rows[name] = {"sequences": len(samples), "tokens": sum(len(s) for s in samples),
                      "loss_tokens": loss_tokens, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                      "loss_tokens_per_cpu_min": round(60 * loss_tokens / max(cpu, 1e-9))}
        print(name, rows[name], flush=True)
    for kind in HELDOUT:
        prompts = heldout_prompts(kind, args.heldout, base.seed, home)
        prompt_samples(target, tokenizer, eos, prompts, base, cache, f"heldout-{kind}-{args.heldout}x{base.max_new_tokens}",
                       False)
    (cache / "data.json").write_text(json.dumps(rows, indent=1))


def stage_run(args, parts) -> None:
    target, tokenizer, eos, home, cache = parts
    recipe = recipe_of(args, args.lever)
    samples = training_samples(target, tokenizer, eos, recipe, cache, home)
    held = {kind: prompt_samples(target, tokenizer, eos, heldout_prompts(kind, args.heldout, recipe.seed, home), recipe,
                                 cache, f"heldout-{kind}-{args.heldout}x{recipe.max_new_tokens}", False)
            for kind in HELDOUT}
    torch.manual_seed(recipe.seed)
    drafter = build_drafter(target, tokenizer, eos, recipe, samples, home)
    result, before, after = fit(drafter, target, samples, held["chat"], recipe, progress=False)
    row = {"lever": args.lever, "recipe": asdict(recipe), "train_tokens": sum(len(s) for s in samples),
           "loss_tokens": int(sum(float(s.loss_mask.sum()) for s in samples)), "train_s": round(result.wall_s, 1),
           "steps": result.steps, "tokens_seen": result.tokens_seen, "untrained_chat": round(before.accept_length, 4)}
    row.update(evaluate_heldout(drafter, target, tokenizer, eos, recipe, args.heldout, cache, home))
    print(json.dumps(row), flush=True)
    (cache / f"lever-{args.lever}.json").write_text(json.dumps(row, indent=1))
    if args.save:  # a drafter artifact bench/spec_decode.py and bench/spec_sweep.py can load
        save_drafter(drafter, args.save, metadata={"version": f"lever-{args.lever}", "recipe": asdict(recipe),
                                                   "heldout_sim_accept_length": row["chat"]}, dtype=torch.bfloat16)


def stage_packaged(args, parts) -> None:
    """The packaged static drafter (or ``--drafter``) on the levers' held-out sets (a
    ``lever-<name>.json`` row)."""
    from tide.drafter.artifact import TargetSpec, load_drafter, read_metadata
    from tide.drafter.static import static_drafter_path

    target, tokenizer, eos, home, cache = parts
    path = args.drafter or static_drafter_path(load_config())
    drafter = load_drafter(path, TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids))
    meta, recipe = read_metadata(path), replace(SELF_GENERATED_RECIPE, heldout_prompts=args.heldout)
    row = {"lever": args.name, "recipe": meta.get("recipe", {}), "train_tokens": meta.get("train_tokens", 0),
           "loss_tokens": meta.get("loss_tokens", meta.get("train_tokens", 0)), "train_s": meta.get("train_s", 0.0),
           "generation_s": meta.get("generation_s"), "steps": "-"}
    row.update(evaluate_heldout(drafter, target, tokenizer, eos, recipe, args.heldout, cache, home))
    print(json.dumps(row), flush=True)
    (cache / f"lever-{args.name}.json").write_text(json.dumps(row, indent=1))


def evaluate_heldout(drafter, target, tokenizer, eos, recipe, n: int, cache: Path, home: Path) -> dict:
    """Simulated accept length at gamma on each held-out set, pooled and per prompt."""
    row = {}
    for kind in HELDOUT:
        held = prompt_samples(target, tokenizer, eos, heldout_prompts(kind, n, recipe.seed, home), recipe, cache,
                              f"heldout-{kind}-{n}x{recipe.max_new_tokens}", False)
        ev = evaluate(drafter, target.embed_weight, target.lm_head_weight, held, recipe.gamma)
        row[kind] = round(ev.accept_length, 4)
        # a target token outside the draft vocab can never be drafted: a ceiling on acceptance
        generated = torch.cat([s.tokens[s.loss_mask.bool()] for s in held])
        row[f"{kind}_coverage"] = round(float(drafter.t2d[generated].float().mean()), 4)
        row[f"{kind}_positions"] = ev.positions
        row[f"{kind}_per_prompt"] = [round(evaluate(drafter, target.embed_weight, target.lm_head_weight, [s],
                                                    recipe.gamma).accept_length, 4) for s in held]
    return row


def interval90(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """90% bootstrap interval of the mean over prompts (seeded)."""
    g = torch.Generator().manual_seed(0)
    x = torch.tensor(values)
    means = x[torch.randint(len(x), (draws, len(x)), generator=g)].mean(1)
    return float(means.quantile(0.05)), float(means.quantile(0.95))


def cell(r: dict, kind: str) -> str:
    """Pooled accept length, and the per-prompt mean's 90% interval where the run recorded it."""
    if f"{kind}_per_prompt" not in r:
        return f"{r[kind]:.3f}"
    lo, hi = interval90(r[f"{kind}_per_prompt"])
    return f"{r[kind]:.3f} [{lo:.2f}, {hi:.2f}]"


def coverage(r: dict) -> str:
    return " / ".join(f"{r[f'{k}_coverage']:.3f}" if f"{k}_coverage" in r else "-" for k in HELDOUT)


def stage_table(args) -> None:
    rows = {p.stem.removeprefix("lever-"): json.loads(p.read_text()) for p in sorted(args.cache.glob("lever-*.json"))}
    base = rows.get("baseline")
    print("| lever | loss tokens | train s | steps | chat | code | korean | chat / baseline | coverage chat / code / korean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("packaged", *LEVERS, *sorted(set(rows) - set(LEVERS) - {"packaged"})):
        if name in rows:
            r = rows[name]
            ratio = f"{r['chat'] / base['chat']:.3f}" if base else "-"
            print(f"| {name} | {r['loss_tokens']} | {r['train_s']} | {r['steps']} | {cell(r, 'chat')} | "
                  f"{cell(r, 'code')} | {cell(r, 'korean')} | {ratio} | {coverage(r)} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=("data", "run", "packaged", "table"))
    p.add_argument("lever", nargs="?", choices=tuple(LEVERS))
    p.add_argument("--gen-prompts", type=int, default=240)
    p.add_argument("--teacher", type=int, default=300)
    p.add_argument("--heldout", type=int, default=24)
    p.add_argument("--train-s", type=float, default=420.0)
    p.add_argument("--cache", type=Path, default=Path("/tmp/tide-static-levers"))
    p.add_argument("--save", type=Path, default=None, help="run: also save the trained drafter here")
    p.add_argument("--drafter", type=Path, default=None, help="packaged: evaluate this drafter folder instead")
    p.add_argument("--name", default="packaged", help="packaged: the row's name (lever-NAME.json)")
    args = p.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.stage == "table":
        stage_table(args)
        return 0
    if args.stage == "run" and not args.lever:
        p.error("run needs a LEVER")
    torch.set_num_threads(1)
    cfg = load_config()
    target, tokenizer, folder = load_target(cfg)
    parts = (target, tokenizer, eos_ids_of(tokenizer, folder), cfg.home_path, args.cache)
    {"data": stage_data, "run": stage_run, "packaged": stage_packaged}[args.stage](args, parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
