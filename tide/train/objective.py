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

Cost on CPU (what a retrain's wall-time cap buys): only step 0's q/k/v projection runs at every
position; everything else runs only where a draft can reach a loss position (``needed_rows``),
and each teacher distribution is computed once per batch. Same loss and gradients as unrolling
every position; the speed-up grows with the share of prompt positions (figures in docs/benchmarks.md).
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
    # where loss_mask is set (only read there):
    in_vocab: torch.Tensor  # [B, T] bool: the target's argmax at t is in the draft vocab
    target_top: torch.Tensor | None = None  # [B, T] int64: the target's argmax at t (full vocab)


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t] <- x[:, t+n]; the last n positions become zeros."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat((x[:, n:], pad), dim=1)


def target_top_tokens(final: torch.Tensor, lm_head_weight: torch.Tensor, chunk_tokens: int = 1024,
                      buffer: torch.Tensor | None = None) -> torch.Tensor:
    """[T] int64: the target's argmax token at each position (one full-vocab projection, chunked).

    ``buffer`` (float32 [>= chunk_tokens, V]) receives each chunk's logits instead of a fresh
    block: called once per sample over a window, differently sized [rows, V] blocks (tens of MB,
    under glibc's mmap threshold once it has risen) interleaved with the small results fragment
    the heap, which grew a retrain's peak by GiBs on a 200k-token window."""
    out = []
    with torch.no_grad():
        weight = lm_head_weight.float()
        for start in range(0, final.shape[0], chunk_tokens):
            x = final[start:start + chunk_tokens].to(weight.device).float()
            logits = F.linear(x, weight) if buffer is None else torch.mm(x, weight.t(), out=buffer[:x.shape[0]])
            out.append(logits.argmax(-1).to(final.device))
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


@dataclass
class Rows:
    """The (row, position) pairs an unroll computes past step 0, and per-step views at t+1+i."""

    b: torch.Tensor  # [n] batch row
    t: torch.Tensor  # [n] position

    def at(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """x[b, t+1+step] for every kept pair (zeros past the end): what step ``step`` predicts."""
        u = self.t + 1 + step
        inside = u < x.shape[1]
        out = x[self.b, u.clamp(max=x.shape[1] - 1)]
        return torch.where(inside.view(-1, *([1] * (out.dim() - 1))), out, torch.zeros_like(out))


def needed_rows(loss_mask: torch.Tensor, length: int) -> Rows:
    """Positions t whose draft steps can count: some step i < length predicts a position t+1+i
    with loss. Prompt positions far from any generated token only ever serve as step-0 keys."""
    need = torch.zeros_like(loss_mask, dtype=torch.bool)
    for step in range(length):
        need |= shift_left(loss_mask, 1 + step) > 0
    b, t = need.nonzero(as_tuple=True)
    return Rows(b=b, t=t)


def unroll(drafter: Eagle3Drafter, embed: torch.Tensor, batch: Batch, length: int, logits: bool = True,
           rows: Rows | None = None, block: bool = False):
    """Yield (step, draft logits [n, Vd] (or the hidden stream [n, H] if not ``logits``), rows).

    ``block``: the block drafter's unroll (tide/drafter/block.py): steps >= 1 read its mask rows
    instead of the next token and the previous step's output; their logits leave out the Markov
    bias, which the caller adds (``block_logits``).

    Step 0 projects q/k/v at every position (its keys are what later positions attend to); the rest
    of step 0 and all of steps >= 1 run only ``rows`` (default ``needed_rows``), so a prompt
    position costs a q/k/v projection, not ``length`` layer passes. The
    attention itself stays dense: queries and diagonal keys of the kept rows are scattered into
    [B, T] layouts (zeros elsewhere, whose outputs are never read).
    """
    s = drafter.shape
    bsz, t = batch.tokens.shape
    rows = rows if rows is not None else needed_rows(batch.loss_mask, length)
    layer = drafter.midlayer
    attn = layer.self_attn
    rep = s.num_heads // s.num_kv_heads
    causal = torch.full((t, t), float("-inf"), device=batch.tokens.device).triu(1)
    hidden = drafter.project(batch.aux)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for step in range(length):
        if step == 0:
            x = layer.attn_input(F.embedding(shift_left(batch.tokens, 1), embed).to(hidden.dtype), hidden)
            cos, sin = drafter.rope_at(torch.arange(t, device=batch.tokens.device).expand(bsz, t))
            q, k, v = attn.qkv(x, cos, sin)
        else:
            if block:  # mask rows: the same input at every row, its own rope position
                embeds, hidden = drafter.mask_rows((len(rows.t),))
                x = layer.attn_input(embeds.to(hidden.dtype), hidden)[None]
            else:
                tokens = rows.at(batch.tokens, step)
                x = layer.attn_input(F.embedding(tokens, embed).to(hidden.dtype), hidden)[None]
            cos, sin = drafter.rope_at((rows.t + step)[None])
            q_rows, k_rows, v_rows = attn.qkv(x, cos, sin)
            q, k, v = (torch.zeros(bsz, t, *r.shape[2:], dtype=r.dtype, device=r.device).index_put((rows.b, rows.t), r[0])
                       for r in (q_rows, k_rows, v_rows))
        keys.append(k.transpose(1, 2).repeat_interleave(rep, dim=1))
        values.append(v.transpose(1, 2).repeat_interleave(rep, dim=1))
        out = _ttt_attention(q.transpose(1, 2), keys, values, causal).transpose(1, 2).reshape(bsz, t, -1)
        if step == 0:  # every position's keys are in; the rest of the layer runs on the kept rows only
            hidden = hidden[rows.b, rows.t]
        hidden = layer.finish(hidden, out[rows.b, rows.t])
        yield step, drafter.logits(hidden) if logits else hidden, rows


def teacher_rows(drafter, lm_head_weight: torch.Tensor, batch: Batch,
                 mask_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher distributions over the draft vocab [n, Vd], one per masked position; [B, T] the
    row of each position, -1 elsewhere): shared by the steps that predict the same position."""
    ub, ut = (mask_all > 0).nonzero(as_tuple=True)
    with torch.no_grad():
        head_draft = lm_head_weight[drafter.draft_to_target].float()
        teacher_p = torch.softmax(F.linear(batch.final[ub, ut].float(), head_draft), dim=-1)
    teacher_at = torch.full(mask_all.shape, -1, dtype=torch.long, device=mask_all.device)
    teacher_at[ub, ut] = torch.arange(len(ub), device=mask_all.device)
    return teacher_p, teacher_at


def eagle3_loss(drafter: Eagle3Drafter, embed: torch.Tensor, lm_head_weight: torch.Tensor, batch: Batch,
                length: int = 7, step_weight: float = 0.8, feature_weight: float = 0.0,
                ce_weight: float = 1.0) -> tuple[torch.Tensor, list[float], list[float]]:
    """Returns (weighted loss, per-step loss values, per-step top-1 accuracy).

    ``ce_weight`` scales SpecForge's soft cross-entropy; ``feature_weight`` adds EAGLE-1-style
    feature regression: smooth-L1 between the drafter's normed output ``norm(h)`` and the target's
    final normed state at the predicted position. With the drafter's norm and head initialised
    from the target's, that dense signal trains far faster on small data (a CPU retrain sees a
    few tens of thousands of tokens); the cross-entropy keeps the objective SpecForge's.
    The teacher distribution of each masked position is computed once and shared by the steps
    that predict it (step i at t and step i-1 at t+1 have the same teacher).
    """
    mask_all = batch.loss_mask * batch.in_vocab
    teacher_at = None
    if ce_weight > 0:
        teacher_p, teacher_at = teacher_rows(drafter, lm_head_weight, batch, mask_all)
    total = torch.zeros((), device=mask_all.device)
    losses, accs = [], []
    for step, hidden, rows in unroll(drafter, embed, batch, length, logits=False):
        # losses only at masked positions: the head and the teacher cost scale with the vocab,
        # so projecting only the positions that count is most of the training speed
        sel = rows.at(mask_all, step) > 0
        n = int(sel.sum())
        loss = torch.zeros((), device=mask_all.device)
        if n == 0:
            losses.append(0.0)
            accs.append(0.0)
            continue
        h_sel = hidden[sel]
        if feature_weight > 0:
            f_sel = rows.at(batch.final, step)[sel].float()
            feat = F.smooth_l1_loss(drafter.norm(h_sel).float(), f_sel, reduction="none").mean(-1)
            loss = loss + feature_weight * feat.mean()
        if ce_weight > 0:
            logits = drafter.lm_head(drafter.norm(h_sel))
            p = teacher_p[rows.at(teacher_at, step)[sel]]
            logq = torch.log_softmax(logits.float(), dim=-1)
            loss = loss + ce_weight * -(p * logq).sum(-1).mean()
            with torch.no_grad():
                accs.append(float((logits.argmax(-1) == p.argmax(-1)).float().mean()))
        total = total + (step_weight ** step) * loss
        losses.append(float(loss.detach()))
    return total, losses, accs or [0.0] * length


@torch.no_grad()
def chain_lengths(drafter: Eagle3Drafter, embed: torch.Tensor, lm_head_weight: torch.Tensor,
                  batch: Batch, gamma: int, block: bool = False) -> tuple[Rows, torch.Tensor, torch.Tensor]:
    """Per position t whose next token is generated: how many of the ``gamma`` drafts from t a
    greedy verify would accept (drafts 0..i all equal the target's full-vocab argmax); ``block``:
    a block drafter's drafts.

    Returns (rows, accepted [n] int64, counted [n] bool: t+1 is generated)."""
    rows = needed_rows(batch.loss_mask, 1)  # the chain only counts from positions t with t+1 generated
    counted = rows.at(batch.loss_mask, 0) > 0
    chain, accepted = counted.clone(), torch.zeros(counted.shape, dtype=torch.long, device=counted.device)
    if not bool(counted.any()):
        return rows, accepted, counted
    for step, logits, _ in unroll(drafter, embed, batch, gamma, rows=rows, block=block):
        if block:  # an accepted prefix is the sequence's own tokens: the bias they give
            logits = block_logits(drafter, logits, rows.at(batch.tokens, step))
        pred = drafter.draft_to_target[logits.argmax(-1)]
        if batch.target_top is not None:  # precomputed once per sample: the full-vocab head is the cost
            target_top = rows.at(batch.target_top, step)
        else:
            target_top = F.linear(rows.at(batch.final, step).float(), lm_head_weight.float()).argmax(-1)
        chain = chain & (pred == target_top) & (rows.at(batch.loss_mask, step) > 0)
        accepted += chain.long()
    return rows, accepted, counted


def block_logits(drafter, base: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
    """[n, Vd] a block drafter's logits: base logits plus the Markov bias of the token before
    each row's prediction (``prev_ids`` [n] target ids: ``rows.at(tokens, step)``)."""
    return base.float() + drafter.bias(prev_ids).float()


def simulated_acceptance(drafter: Eagle3Drafter, embed: torch.Tensor, lm_head_weight: torch.Tensor,
                         batch: Batch, gamma: int) -> tuple[float, list[float], int]:
    """Greedy chain acceptance under teacher forcing, averaged over every generated position.

    Returns (mean tokens per target forward = 1 + accepted, per-position acceptance rates,
    positions counted). Decoding starts a step only where the last one ended, so it lands on
    easy stretches less often than this average does (``replayed_acceptance``)."""
    return average_chain(*chain_lengths(drafter, embed, lm_head_weight, batch, gamma)[1:], gamma)


def average_chain(accepted: torch.Tensor, counted: torch.Tensor, gamma: int) -> tuple[float, list[float], int]:
    """``simulated_acceptance`` from ``chain_lengths``' output."""
    n = int(counted.sum())
    if n == 0:
        return 1.0, [0.0] * gamma, 0
    acc = accepted[counted]
    per_pos = [float((acc > i).sum()) / n for i in range(gamma)]
    return 1.0 + sum(per_pos), per_pos, n


def replayed_acceptance(drafter: Eagle3Drafter, embed: torch.Tensor, lm_head_weight: torch.Tensor,
                        batch: Batch, gamma: int, max_tokens: int | None = None) -> tuple[int, int]:
    """Greedy decoding replayed on the teacher-forced text: from each row's first generated
    token, a step at t commits its accepted drafts plus the target's token and the next step
    starts where it ended, as ``tide.spec.generate`` decodes (without a stop rule), until a row
    has committed ``max_tokens`` (default: to the end of its text).

    Returns (tokens committed, steps) over the batch."""
    return replay_chains(*chain_lengths(drafter, embed, lm_head_weight, batch, gamma), max_tokens)


def replay_chains(rows: Rows, accepted: torch.Tensor, counted: torch.Tensor,
                  max_tokens: int | None = None) -> tuple[int, int]:
    """``replayed_acceptance`` from ``chain_lengths``' output."""
    at: dict[int, dict[int, int]] = {}
    for b, t, a, ok in zip(rows.b.tolist(), rows.t.tolist(), accepted.tolist(), counted.tolist()):
        if ok:
            at.setdefault(b, {})[t] = a
    tokens = steps = 0
    for chains in at.values():
        t, end, made = min(chains), max(chains), 0
        while t <= end and (max_tokens is None or made < max_tokens):
            if t not in chains:  # not generated (a gap in the loss mask): decoding never starts a step there
                t += 1
                continue
            n = chains[t] + 1
            made, steps, t = made + n, steps + 1, t + n
        tokens += made
    return tokens, steps
