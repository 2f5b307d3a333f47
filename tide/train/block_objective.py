"""DSpark's training objective for the block drafter (tide/drafter/block.py), in plain torch.

Over the same unroll as EAGLE3's (``objective.unroll(block=True)``: step 0 is the chain's first
depth, steps >= 1 the mask rows, each attending the step-0 keys at positions <= t and the block's
earlier rows at t):
1. step k's logits = base logits + the Markov bias of the sequence's token before the position it
   predicts (teacher forcing: a greedy verify accepts only prefixes equal to those tokens);
2. per step, against the target's distribution over the draft vocab (``p``, as EAGLE3's teacher):
   ``ce_weight`` x soft cross-entropy + ``tv_weight`` x total variation 0.5 |p - q|_1 (TV is what
   greedy acceptance rewards: P(accept) = sum_x min(p, q) = 1 - TV);
3. position weights exp(-k / gamma) (DSpark's w_k = exp(-(k-1)/gamma) for k from 1).
DSpark's third term, BCE of a confidence head, is left out: the trial measures drafts, and a head
is fitted afterwards as for every drafter (tide/train/confidence.py).
"""
from __future__ import annotations

import math

import torch

from tide.drafter.block import BlockDrafter
from tide.train.objective import Batch, block_logits, teacher_rows, unroll

CE_WEIGHT, TV_WEIGHT = 0.1, 0.9  # DSpark's loss weights


def block_loss(drafter: BlockDrafter, embed: torch.Tensor, lm_head_weight: torch.Tensor, batch: Batch,
               length: int = 4, ce_weight: float = CE_WEIGHT,
               tv_weight: float = TV_WEIGHT) -> tuple[torch.Tensor, list[float], list[float]]:
    """(weighted loss, per-step loss values, per-step top-1 agreement with the teacher)."""
    mask_all = batch.loss_mask * batch.in_vocab
    teacher_p, teacher_at = teacher_rows(drafter, lm_head_weight, batch, mask_all)
    total = torch.zeros((), device=mask_all.device)
    losses, accs = [], []
    for step, hidden, rows in unroll(drafter, embed, batch, length, logits=False, block=True):
        sel = rows.at(mask_all, step) > 0
        if not bool(sel.any()):
            losses.append(0.0)
            accs.append(0.0)
            continue
        logits = block_logits(drafter, drafter.logits(hidden[sel]), rows.at(batch.tokens, step)[sel])
        p = teacher_p[rows.at(teacher_at, step)[sel]]
        logq = torch.log_softmax(logits, dim=-1)
        ce = -(p * logq).sum(-1).mean()
        tv = 0.5 * (p - logq.exp()).abs().sum(-1).mean()
        loss = ce_weight * ce + tv_weight * tv
        total = total + math.exp(-step / length) * loss
        losses.append(float(loss.detach()))
        with torch.no_grad():
            accs.append(float((logits.argmax(-1) == p.argmax(-1)).float().mean()))
    return total, losses, accs
