"""The EAGLE3 training objective (SpecForge semantics) in plain torch, CPU-friendly.

For a batch of sequences with target aux states ``a_t`` ([3H]), final normed states ``f_t`` and
tokens ``x_t``, test-time training (TTT) unrolls ``L`` draft steps:
1. step 0 at position t reads ``fc(a_t)`` and ``embed(x_{t+1})``; step i>0 reads the drafter's own
   step i-1 output at t and ``embed(x_{t+1+i})`` (the tokens it would have drafted, if accepted);
2. attention at step i (rope position t+i) sees step-0 keys at positions <= t plus the keys of
   steps 1..i at position t only: exactly what the cached drafter sees at inference;
3. the teacher at step i is the target distribution at position t+1+i restricted to the draft
   vocab, ``softmax(f_{t+1+i} W_lm[t2d])``; loss = soft cross-entropy, masked by the loss mask at
   t+1+i and by "the target's top token is in the draft vocab", averaged over masked positions;
4. total loss = sum_i w^i * loss_i (w = 0.8 by default).
The same unroll, with argmax instead of the loss, gives the simulated acceptance length: the chain
of draft positions accepted under greedy verification (``simulated_acceptance``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tide.drafter.model import Eagle3Drafter


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] int64
    aux: torch.Tensor  # [B, T, 3H]
    final: torch.Tensor  # [B, T, H]
    loss_mask: torch.Tensor  # [B, T] float (0 on padding too)
    in_vocab: torch.Tensor  # [B, T] bool: the target's argmax at t is in the draft vocab
    target_top: torch.Tensor | None = None  # [B, T] int64: the target's argmax at t (full vocab)


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t] <- x[:, t+n]; the last n positions become zeros."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat((x[:, n:], pad), dim=1)


def teacher_logits(final: torch.Tensor, lm_head_weight: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """Target logits restricted to the draft vocab: [B, T, Vd]."""
    return F.linear(final.float(), lm_head_weight[draft_ids].float())


def target_top_tokens(final: torch.Tensor, lm_head_weight: torch.Tensor, chunk_tokens: int = 1024) -> torch.Tensor:
    """[T] int64: the target's argmax token at each position (one full-vocab projection, chunked)."""
    out = []
    with torch.no_grad():
        for start in range(0, final.shape[0], chunk_tokens):
            out.append(F.linear(final[start:start + chunk_tokens].float(), lm_head_weight.float()).argmax(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def _ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                   causal_mask: torch.Tensor) -> torch.Tensor:
    """q/k/v: [B, heads, T, hd] (kv already repeated for GQA); keys[0] causal, keys[1:] diagonal."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = [torch.matmul(q, keys[0].transpose(-1, -2)) * scale + causal_mask]
    scores += [((q * k).sum(-1) * scale)[..., None] for k in keys[1:]]
    weights = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    t = q.shape[2]
    out = torch.matmul(weights[..., :t], values[0])
    for i, v in enumerate(values[1:]):
        out = out + weights[..., t + i, None] * v
    return out


def unroll(drafter: Eagle3Drafter, embed: torch.Tensor, batch: Batch, length: int, logits: bool = True):
    """Yield (step, draft logits [B, T, Vd] (or the hidden stream if not ``logits``), step mask
    [B, T], shifted teacher final states)."""
    s = drafter.shape
    bsz, t = batch.tokens.shape
    layer = drafter.midlayer
    attn = layer.self_attn
    rep = s.num_heads // s.num_kv_heads
    causal = torch.full((t, t), float("-inf")).triu(1)
    hidden = drafter.project(batch.aux)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    positions = torch.arange(t).expand(bsz, t)
    for step in range(length):
        tokens = shift_left(batch.tokens, 1 + step)
        x = layer.attn_input(F.embedding(tokens, embed).to(hidden.dtype), hidden)
        cos, sin = drafter.rope_at(positions + step)
        q, k, v = attn.qkv(x, cos, sin)
        keys.append(k.transpose(1, 2).repeat_interleave(rep, dim=1))
        values.append(v.transpose(1, 2).repeat_interleave(rep, dim=1))
        out = _ttt_attention(q.transpose(1, 2), keys, values, causal)
        hidden = layer.finish(hidden, out.transpose(1, 2).reshape(bsz, t, -1))
        mask = shift_left(batch.loss_mask * batch.in_vocab, 1 + step)
        yield step, drafter.logits(hidden) if logits else hidden, mask, shift_left(batch.final, 1 + step)


def eagle3_loss(drafter: Eagle3Drafter, embed: torch.Tensor, lm_head_weight: torch.Tensor, batch: Batch,
                length: int = 7, step_weight: float = 0.8, feature_weight: float = 0.0,
                ce_weight: float = 1.0) -> tuple[torch.Tensor, list[float], list[float]]:
    """Returns (weighted loss, per-step loss values, per-step top-1 accuracy).

    ``ce_weight`` scales SpecForge's soft cross-entropy; ``feature_weight`` adds EAGLE-1-style
    feature regression: smooth-L1 between the drafter's normed output ``norm(h)`` and the target's
    final normed state at the predicted position. With the drafter's norm and head initialised
    from the target's, that dense signal trains far faster on small data (a CPU retrain sees a
    few tens of thousands of tokens); the cross-entropy keeps the objective SpecForge's.
    """
    draft_ids = drafter.draft_to_target
    head_draft = lm_head_weight[draft_ids].float() if ce_weight > 0 else None
    total = torch.zeros(())
    losses, accs = [], []
    for step, hidden, mask, final in unroll(drafter, embed, batch, length, logits=False):
        # losses only at masked positions: the head and the teacher cost scale with the vocab,
        # so projecting only the positions that count is most of the training speed
        sel = mask > 0
        n = int(sel.sum())
        loss = torch.zeros(())
        if n == 0:
            losses.append(0.0)
            accs.append(0.0)
            continue
        h_sel, f_sel = hidden[sel], final[sel].float()
        if feature_weight > 0:
            feat = F.smooth_l1_loss(drafter.norm(h_sel).float(), f_sel, reduction="none").mean(-1)
            loss = loss + feature_weight * feat.mean()
        if ce_weight > 0:
            logits = drafter.lm_head(drafter.norm(h_sel))
            with torch.no_grad():
                teacher = F.linear(f_sel, head_draft)
                p = torch.softmax(teacher, dim=-1)
            logq = torch.log_softmax(logits.float(), dim=-1)
            loss = loss + ce_weight * -(p * logq).sum(-1).mean()
            with torch.no_grad():
                accs.append(float((logits.argmax(-1) == teacher.argmax(-1)).float().mean()))
        total = total + (step_weight ** step) * loss
        losses.append(float(loss.detach()))
    return total, losses, accs or [0.0] * length


@torch.no_grad()
def simulated_acceptance(drafter: Eagle3Drafter, embed: torch.Tensor, lm_head_weight: torch.Tensor,
                         batch: Batch, gamma: int) -> tuple[float, list[float], int]:
    """Greedy chain acceptance under teacher forcing on generated positions.

    At each position t whose next token is generated (mask at step 0), draft i is accepted if
    drafts 0..i all match the target's argmax (over the full vocab). Returns (mean tokens per
    target forward = 1 + accepted, per-position acceptance rates, positions counted).
    """
    chain = None
    base_mask = None
    per_pos = []
    for step, logits, mask, final in unroll(drafter, embed, batch, gamma):
        pred = drafter.draft_to_target[logits.argmax(-1)]
        if batch.target_top is not None:  # precomputed once per sample: the full-vocab head is the cost
            target_top = shift_left(batch.target_top, 1 + step)
        else:
            target_top = F.linear(final.float(), lm_head_weight.float()).argmax(-1)
        ok = (pred == target_top) & (shift_left(batch.loss_mask, 1 + step) > 0)
        if chain is None:
            base_mask = shift_left(batch.loss_mask, 1) > 0
            chain = ok
        else:
            chain = chain & ok
        per_pos.append(chain)
    n = int(base_mask.sum())
    if n == 0:
        return 1.0, [0.0] * gamma, 0
    rates = [float((c & base_mask).sum()) / n for c in per_pos]
    return 1.0 + sum(rates), rates, n
