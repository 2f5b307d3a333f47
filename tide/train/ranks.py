"""The ranks of a ``torchrun`` retrain: rank 0 runs ``run_retrain`` (plan, registry, evaluation,
MLflow, registering); every other rank only trains its share (``tide/train/distributed.py``).

Rank 0 plans the window and resolves the parent, then sends both to the other ranks (``announce``),
so every rank trains on the same requests from the same warm start even while new data lands;
``None`` tells them there is nothing to do. The other ranks load the target, the parent and the
window themselves (the dataset and the registry cache are on the node's filesystem) and join
the training's collectives; they write no result and log nothing to MLflow.
"""
from __future__ import annotations

import logging

from tide.train.distributed import Ranks, init_group, ranks_from_env, share

log = logging.getLogger(__name__)


def current_ranks() -> Ranks:
    return ranks_from_env()


def train_kwargs(tc, progress: bool = False) -> dict:
    """The trainer's arguments from ``train.*`` (the same on every rank)."""
    return dict(epochs=tc.epochs, lr=tc.lr, batch_tokens=tc.batch_tokens, max_len=tc.max_seq_len,
                ttt_length=tc.ttt_length, step_weight=tc.step_weight_decay, seed=tc.seed, progress=progress,
                max_wall_s=tc.max_train_s, feature_weight=tc.feature_weight, ce_weight=tc.ce_weight,
                train_head=tc.train_head, precision=tc.precision, ranks=current_ranks(), anchor=tc.anchor)


def start(cfg):
    """This process's device; joins the process group when torchrun started several ranks."""
    from tide.train.device import resolve_device

    ranks = current_ranks()
    device = resolve_device(cfg.train.device, ranks.local_rank)
    init_group(ranks, device)
    return device


def announce(plan, parent_folder) -> None:
    """Rank 0: the plan and the parent's folder to the other ranks (None, None: nothing to do)."""
    share(current_ranks(), None if plan is None else (plan, str(parent_folder)))


def run_rank(cfg, data_dir, spill_dir) -> int:
    """A rank other than 0: train its share of rank 0's plan from ``data_dir`` (states spilled
    under ``spill_dir``, as on rank 0); exit code 0."""
    from pathlib import Path

    from tide.drafter.artifact import TargetSpec, load_drafter
    from tide.models.target import load_target_heads
    from tide.train.rehearsal import load_training
    from tide.train.trainer import train

    device = start(cfg)
    got = share(current_ranks(), None)
    if got is None:
        return 0
    plan, parent_folder = got
    target = load_target_heads(cfg)  # embeddings + lm_head: all training reads of the target
    drafter = load_drafter(Path(parent_folder), TargetSpec(target.shape.hidden_size, target.shape.vocab_size,
                                                           target.aux_layer_ids))
    tc = cfg.train
    data = load_training(cfg, data_dir, plan, spill_dir)  # rank 0 cached the rehearsal pool before sharing
    try:
        if len(data.train) < tc.min_samples or len(data.heldout) < tc.min_heldout_samples:
            return 0  # rank 0 reads the same requests and finds the same: nothing to do
        result = train(drafter, target.embed_weight, target.lm_head_weight, data.train, device=device,
                       **train_kwargs(tc))
    finally:
        data.close()
    log.info("rank %d: %d steps", current_ranks().rank, result.steps)
    return 0
