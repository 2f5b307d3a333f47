"""Rehearsal: the drafter's own training distribution stands in for history a young dataset lacks.

A retrain keeps the older workloads' acceptance by replaying older captured requests
(``train.replay_ratio`` per recent training request, tide/train/window.py). Right after a shift
the dataset is young: the replay asks for more older requests than there are (a demo's full
retrain after a shift to code asks ~170 and finds the first phase's ~50), the drafter sees mostly
the new traffic, and the old workload's acceptance slips. Rehearsal fills that shortfall with the
target's own answers to prompts of the workload the drafter was trained on: the static recipe's
prompts, answered as the recipe answered them (tide/train/static.py).

Steps:
1. ``rehearsal_count``: the replay's shortfall (asked minus planned), at most
   ``train.rehearsal_prompts``; 0 for a shift's patch (a short run on its own window, replaced by
   the full retrain, whose swap time is what a patch is for), for the SpecForge backend (it trains
   on the window as exported from the table: tide/train/specforge_backend.py) and when off;
2. ``rehearsal_pool``: ``train.rehearsal_prompts`` prompts of ``train.rehearsal_workload``'s train
   split (the static recipe's seed and order: the head of the prompts the shipped drafter trained
   on), answered greedily by the target; generated once per home and target and cached under
   ``<home>/train-cache/rehearsal`` (safetensors), so only the first retrain that needs it loads the
   whole target;
3. ``add_rehearsal``: the pool's first ``n`` samples join the training set after the window's (in
   the window's state file when it spills). A re-run of a retrain on the same table version plans
   the same count and takes the same samples: the lineage holds.
Held-out evaluation never sees rehearsal samples: the old workload is judged on its own traffic.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tide.train.trainer import Sample
from tide.train.window import WindowData, WindowPlan, load_window

log = logging.getLogger(__name__)


def rehearsal_count(tc, plan: WindowPlan) -> int:
    """Rehearsal samples a retrain adds: what the replay asked and the dataset could not give."""
    if tc.patch or tc.rehearsal_prompts <= 0 or tc.backend == "specforge":
        return 0
    asked = int(tc.replay_ratio * len(plan.recent) + 0.5)  # plan_window's rounding
    return max(0, min(tc.rehearsal_prompts, asked - len(plan.replay)))


def pool_path(cfg) -> Path:
    """Where the pool is cached: named by target, workload and size, so a change builds a new one."""
    from tide.train.static import StaticRecipe
    from tide.workloads import workload_name

    recipe = StaticRecipe()
    workload = workload_name(cfg.train.rehearsal_workload)  # a JSONL file's tag or stem, not its path
    model = (cfg.model.model_id or cfg.model.target).replace("/", "--")
    name = f"{model}-{workload}-{cfg.train.rehearsal_prompts}x{recipe.max_prompt_tokens}+{recipe.max_new_tokens}"
    return cfg.home_path / "train-cache" / "rehearsal" / f"{name}.safetensors"


def rehearsal_pool(cfg) -> list[Sample]:
    """The cached pool, generated first if absent (the whole target loaded for it, then freed). A
    home that cannot be written (a Job's read-only image without the pool) still gets the samples."""
    from tide.train.generation_pool import load_samples, save_samples

    path = pool_path(cfg)
    if path.exists():
        return load_samples(path)
    t0 = time.monotonic()
    samples = _generate(cfg)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_samples(samples, path)
        where = f"cached at {path}"
    except OSError as exc:
        where = f"not cached ({exc}): every retrain that needs it generates it again"
    log.info("rehearsal: %d samples generated in %.1f s, %s", len(samples), time.monotonic() - t0, where)
    return samples


def _generate(cfg) -> list[Sample]:
    from tide import workloads
    from tide.models.target import eos_ids_of, load_target
    from tide.train.offline import generate_samples, render_prompt
    from tide.train.static import StaticRecipe

    recipe = StaticRecipe()
    target, tokenizer, folder = load_target(cfg)
    prompts = workloads.split_workload(cfg.train.rehearsal_workload, "train", cfg.train.rehearsal_prompts,
                                       seed=recipe.seed, home=cfg.home_path)
    ids = [render_prompt(tokenizer, p.chat_messages(), recipe.max_prompt_tokens) for p in prompts]
    return generate_samples(target, ids, recipe.max_new_tokens, eos_ids_of(tokenizer, folder),
                            batch_size=recipe.generation_batch, progress=False)


def add_rehearsal(data: WindowData, pool: list[Sample], n: int, max_seq_len: int, all_positions: bool = False) -> int:
    """The pool's first ``n`` samples appended to ``data.train``, masked as the window's training
    requests are (generated positions, or all with ``all_positions``); returns how many were added."""
    added = pool[:n]
    for s in added:
        rows = min(len(s), max_seq_len)
        aux, final = s.states(rows)
        mask = torch.ones(rows) if all_positions else s.loss_mask[:rows].clone()
        sample = Sample(tokens=s.tokens[:rows].clone(), loss_mask=mask, aux=None, final=None)
        if data.store is not None:  # beside the window's states: memory stays set by the batch
            sample.spill = data.store.put(aux, final)
        else:
            sample.aux, sample.final = aux, final
        data.train.append(sample)
        data.train_tokens += rows
    return len(added)


def load_training(cfg, data_dir, plan: WindowPlan, spill_dir: Path | None,
                  pool: list[Sample] | None = None) -> WindowData:
    """``load_window`` plus the plan's rehearsal (from ``pool``, else the cached pool): what every
    rank and bench trains on. A pool smaller than the count planned (a short workload file) gives
    all it has, and ``plan.rehearsal`` is set to that, so the lineage records what was trained on."""
    tc = cfg.train
    data = load_window(data_dir, plan, tc.train_on_prompt, tc.max_seq_len, spill_dir=spill_dir)
    try:
        if plan.rehearsal:
            pool = pool if pool is not None else rehearsal_pool(cfg)
            plan.rehearsal = add_rehearsal(data, pool, plan.rehearsal, tc.max_seq_len, tc.train_on_prompt)
    except BaseException:
        data.close()
        raise
    return data
