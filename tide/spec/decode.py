"""Speculative decoding as plain functions: draft, verify, accept. No I/O, no logging.

State per batch row ``b`` (kept by the engine): the target has cached positions ``0..t_len-1``;
``pending`` is the last committed token, not yet fed to the target; ``feed_*`` are the target
features the drafter has not consumed yet: aux states of positions ``feed_start..t_len-1``, each
paired with the token that followed it (the last pairing is with ``pending``).

One step (``speculative_step``):
1. draft: the drafter consumes the feed (writing its KV cache with target features) and its last
   output proposes d1; then up to ``gamma-1`` more cached steps on its own hidden stream propose
   d2..dγ. With ``stop_prob`` > 0 a row stops drafting after a token whose draft probability is
   below it (the drafter knows when it is guessing); with a calibrated confidence head on the
   drafter, a greedy row stops once the chain's survival probability drops below it instead;
   the step stops when every row has stopped. With a planner (the cost scheduler,
   tide/spec/schedule.py) the planner decides after each depth whether drafting on pays and how
   many drafts to keep; the drafts are truncated to that (possibly zero) before verification;
2. verify: one target forward over ``[pending, d1..dk]`` at positions ``t_len..t_len+k`` (k = the
   longest row's draft; a shorter row's tail is padding that is never accepted). On CPU a verify
   costs more per token fed, so not feeding drafts that would be rejected is most of the point;
3. accept: greedy rows keep the longest prefix equal to the target's argmax, then the target's
   token; sampling rows use rejection sampling (accept d with prob min(1, p/q), else resample
   from norm(max(p - q, 0))), which leaves the output distributed exactly as the target's;
   if every draft is accepted the target's next token is the bonus;
4. commit: positions ``t_len..t_len+n_acc`` are now valid in the target cache (rejected ones are
   forgotten by lowering the row's length), and their aux states become the next feed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from tide.drafter.model import Eagle3Drafter
from tide.models.llama import KVCache, LlamaTarget
from tide.models.rowkernel import PASS_ROWS
from tide.spec import tree


@dataclass
class RowInput:
    slot: int
    t_len: int
    pending: int
    feed_start: int
    feed_tokens: torch.Tensor  # [m] tokens following each feed position (last = pending)
    feed_aux: torch.Tensor  # [m, 3H]
    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    top_k: int = 0  # <= 0: no top-k filter
    drafter_first_pos: int = 0  # the drafter attends to its keys from here on (set by a swap)


@dataclass
class RowResult:
    committed: list[int]  # accepted drafts + correction/bonus token
    n_accepted: int
    fed_tokens: torch.Tensor  # [n_accepted+1] tokens fed at positions t_len.. (now cached)
    aux_hidden: torch.Tensor  # [n_accepted+1, 3H] for those positions
    final_hidden: torch.Tensor  # [n_accepted+1, H]


@dataclass
class StepStats:
    gamma: int
    accepted: list[int] = field(default_factory=list)  # per row
    position_accepts: list[int] = field(default_factory=list)  # [gamma]: rows accepting draft i
    drafted: list[int] = field(default_factory=list)  # per row: tokens drafted (<= gamma)
    draft_depth: int = 0  # depths the drafter ran (its cost), >= the longest kept draft
    draft_s: float = 0.0
    verify_s: float = 0.0
    feed_positions: int = 0  # the longest drafter feed of the step (long after prefill or target-only steps)
    siblings: int = 0  # depth-1 alternatives verified per row (tide/spec/tree.py)
    sibling_accepts: int = 0  # rows whose first accepted token was a sibling

    @property
    def tokens_per_forward(self) -> float:
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))


def filtered_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """Softmax at ``temperature`` restricted to the top-k, then the top-p nucleus (the distribution
    to preserve; vLLM's order)."""
    logits = logits.float()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Planner(Protocol):
    """Decides a step's draft length while drafting (tide.spec.schedule.StepPlan)."""

    caps: list[int]  # the most drafts row b may keep
    drafted: int  # set by draft(): the depths the drafter ran

    def after_depth(self, depth: int, raw: list[float | None]) -> int:
        """``depth`` drafts done, ``raw[b]`` row b's live chain survival (None: no live signal);
        returns the drafts to keep (drafting goes on while it exceeds ``depth``)."""


def draft(drafter: Eagle3Drafter, embed: torch.Tensor, cache: KVCache, rows: list[RowInput],
          gamma: int, stop_prob: float = 0.0, planner: Planner | None = None,
          siblings: list[list[int]] | None = None,
          n_siblings: int = 0) -> tuple[torch.Tensor, list[torch.Tensor | None], list[int]]:
    """Propose up to ``gamma`` target-vocab tokens per row.

    Returns ([B, k] ids, per-row q probs [k, V] or None, per-row draft lengths); k <= γ is the
    longest row's length. A row stops after a draft whose probability is below ``stop_prob``
    (at the row's temperature, 1 for greedy rows); every row drafts at least one token, unless a
    ``planner`` truncates the drafts (to zero, possibly). With ``n_siblings`` > 0, ``siblings``
    (a list) receives each row's ``n_siblings`` next-best depth-1 tokens (target ids).
    """
    bsz = len(rows)
    m = max(r.feed_tokens.numel() for r in rows)
    tokens = torch.zeros(bsz, m, dtype=torch.long)
    aux = torch.zeros(bsz, m, rows[0].feed_aux.shape[-1], dtype=rows[0].feed_aux.dtype)
    positions = torch.zeros(bsz, m, dtype=torch.long)
    last = torch.zeros(bsz, dtype=torch.long)
    for b, r in enumerate(rows):
        n = r.feed_tokens.numel()
        tokens[b, :n] = r.feed_tokens
        aux[b, :n] = r.feed_aux
        # padding continues the row's positions; never attended by real queries (causal)
        positions[b] = r.feed_start + torch.arange(m)
        last[b] = n - 1
    slots = torch.tensor([r.slot for r in rows])
    first = torch.tensor([r.drafter_first_pos for r in rows]) if any(r.drafter_first_pos for r in rows) else None
    d2t_ids = drafter.draft_to_target
    vocab = embed.shape[0]
    out_tokens = torch.zeros(bsz, gamma, dtype=torch.long)
    q_probs: list[list[torch.Tensor]] = [[] for _ in rows]
    lengths = [0] * bsz
    active = [True] * bsz
    with torch.inference_mode():
        hidden = drafter.project(aux)
        h = drafter.step(F.embedding(tokens, embed), hidden, cache, slots, positions, first)
        h = h[torch.arange(bsz), last][:, None]  # [B, 1, H]
        pos = positions[torch.arange(bsz), last][:, None]
        fed = tokens[torch.arange(bsz), last]  # [B] the token each row's next draft follows
        chain, raw_prod, keep = torch.ones(bsz), torch.ones(bsz), gamma
        for i in range(gamma):
            logits = drafter.logits(h)[:, 0].float()  # [B, draft_vocab]
            top_prob = None
            if (stop_prob > 0 or planner is not None) and any(r.temperature <= 0 for r in rows):
                top_prob, chain = _greedy_confidence(drafter, embed, h[:, 0], fed, logits, i, chain)
            for b, r in enumerate(rows):
                if not active[b]:
                    out_tokens[b, i] = out_tokens[b, i - 1]  # padding: verified, never accepted
                    continue
                if r.temperature > 0:
                    q = torch.softmax(logits[b] / r.temperature, dim=-1)
                    d = int(torch.multinomial(q, 1, generator=r.generator))
                    full = torch.zeros(vocab)
                    full[d2t_ids] = q
                    q_probs[b].append(full)
                    confidence = float(q[d])
                else:
                    d = int(logits[b].argmax())
                    confidence = top_prob[b] if top_prob is not None else 1.0
                if i == 0 and n_siblings > 0 and siblings is not None:
                    siblings.append(d2t_ids[tree.alternatives(logits[b], d, n_siblings)].tolist())
                out_tokens[b, i] = d2t_ids[d]
                lengths[b] = i + 1
                active[b] = confidence >= stop_prob
            fed = out_tokens[:, i]
            if planner is not None:
                if drafter.confidence is None and top_prob is not None:
                    raw_prod = raw_prod * torch.tensor(top_prob)
                live = chain if drafter.confidence is not None else raw_prod
                keep = planner.after_depth(i + 1, [float(live[b]) if r.temperature <= 0 else None
                                                   for b, r in enumerate(rows)])
                if keep <= i + 1:
                    break
            if i + 1 < gamma and any(active):
                pos = pos + 1
                h = drafter.step(F.embedding(out_tokens[:, i:i + 1], embed), h, cache, slots, pos, first)
            elif i + 1 < gamma:
                break
    if planner is not None:
        planner.drafted = max(lengths)  # the depths the drafter ran: its cost
        lengths = [min(n, keep, cap) for n, cap in zip(lengths, planner.caps)]
    k = max(lengths)
    return out_tokens[:, :k], [torch.stack(q)[:n] if q else None for q, n in zip(q_probs, lengths)], lengths


def _greedy_confidence(drafter: Eagle3Drafter, embed: torch.Tensor, hidden: torch.Tensor, fed: torch.Tensor,
                       logits: torch.Tensor, depth: int, chain: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    """Greedy rows' confidence in this draft, one batched computation per step: the calibrated
    survival of the whole chain so far when the drafter has a confidence head, else the draft's
    top probability (the head's probabilities multiply; raw top probabilities are not calibrated
    enough to)."""
    if drafter.confidence is None:
        return torch.softmax(logits, dim=-1).amax(-1).tolist(), chain
    survival = drafter.confidence.survival(hidden, F.embedding(fed, embed), logits, depth,
                                           drafter.shape.rms_norm_eps)
    chain = chain * survival
    return chain.tolist(), chain


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """One row: draft [γ], logits [γ+1, V] → (accepted count, next token)."""
    target = target_logits.argmax(-1)
    match = (draft_tokens == target[:-1]).long()
    n = int(match.cumprod(0).sum())
    return n, int(target[n])


def first_rejection(draft_tokens: torch.Tensor, q_probs: torch.Tensor, p: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """Rejection sampling's walk (Leviathan et al. / Chen et al.) over one row's drafts with target
    probabilities ``p`` [γ+1, V]: (accepted count, the distribution the next token comes from: the
    residual norm(max(p - q, 0)) after a rejection, the bonus position's p when all pass)."""
    gamma = draft_tokens.numel()
    for i in range(gamma):
        d = int(draft_tokens[i])
        u = float(torch.rand((), generator=generator))
        if u * float(q_probs[i, d]) < float(p[i, d]):  # u < p/q without dividing by zero
            continue
        residual = torch.clamp(p[i] - q_probs[i], min=0)
        total = residual.sum()
        return i, (residual / total if total > 0 else p[i])
    return gamma, p[gamma]


def accept_sampling(draft_tokens: torch.Tensor, q_probs: torch.Tensor, target_logits: torch.Tensor,
                    temperature: float, top_p: float, generator: torch.Generator | None,
                    top_k: int = 0) -> tuple[int, int]:
    """One row, rejection sampling: output ~ target distribution."""
    p = filtered_probs(target_logits, temperature, top_p, top_k)  # [γ+1, V]
    n, dist = first_rejection(draft_tokens, q_probs, p, generator)
    return n, int(torch.multinomial(dist, 1, generator=generator))


def accept_row(r: RowInput, draft_tokens: torch.Tensor, q_probs: torch.Tensor | None, logits: torch.Tensor,
               siblings: list[int]) -> tuple[int, int, int | None]:
    """One row of a verify laid out as ``[pending, d1..dk, padding.., s1..sm]`` (logits [1+K+m, V],
    tide/spec/tree.py): (accepted count, next token, the accepted sibling's index or None)."""
    k, first_sibling = draft_tokens.numel(), logits.shape[0] - len(siblings)
    if r.temperature > 0:
        p = filtered_probs(logits[:k + 1], r.temperature, r.top_p, r.top_k)
        n, dist = first_rejection(draft_tokens, q_probs, p, r.generator)
        j = None
        if n == 0 and siblings:
            j, dist = tree.offer(dist, siblings, r.generator)
            if j is not None:  # the next token follows the sibling: the target's own distribution there
                dist = filtered_probs(logits[first_sibling + j], r.temperature, r.top_p, r.top_k)
        return (n if j is None else 1), int(torch.multinomial(dist, 1, generator=r.generator)), j
    n, nxt = accept_greedy(draft_tokens, logits[:k + 1])
    if n == 0 and nxt in siblings:
        j = siblings.index(nxt)
        return 1, int(logits[first_sibling + j].argmax()), j
    return n, nxt, None


def verify(target: LlamaTarget, cache: KVCache, rows: list[RowInput], draft_tokens: torch.Tensor,
           siblings: list[list[int]] | None = None):
    """One target forward over [pending, d1..dγ] (then each row's depth-1 siblings) for every row."""
    parts = [torch.tensor([[r.pending] for r in rows]), draft_tokens]
    layout = None
    if siblings:
        parts.append(torch.tensor(siblings))
        layout = tree.layout(draft_tokens.shape[1], len(siblings[0]))
    fed = torch.cat(parts, dim=1)
    start = torch.tensor([r.t_len for r in rows])
    slots = torch.tensor([r.slot for r in rows])
    return fed, target.forward(fed, start, cache, slots, tree=layout)


def speculative_step(target: LlamaTarget, drafter: Eagle3Drafter, target_cache: KVCache,
                     drafter_cache: KVCache, rows: list[RowInput], gamma: int,
                     stop_prob: float = 0.0, planner: Planner | None = None,
                     siblings: int = 0) -> tuple[list[RowResult], StepStats]:
    """One draft-verify-accept step. ``siblings``: the most depth-1 alternatives verified beside
    each row's chain (tide/spec/tree.py), as many as fit the weight passes the chain's verify makes
    anyway; none with a ``planner``, whose step costs price the chain alone."""
    n_sib = siblings if planner is None else 0
    t0 = time.perf_counter()
    sibs: list[list[int]] = []
    draft_tokens, q_probs, lengths = draft(drafter, target.embed_weight, drafter_cache, rows, gamma, stop_prob,
                                           planner, sibs, n_sib)
    t1 = time.perf_counter()
    m = tree.budget(n_sib, len(rows), draft_tokens.shape[1], PASS_ROWS) if min(lengths) > 0 else 0
    sibs = [s[:m] for s in sibs]
    fed, out = verify(target, target_cache, rows, draft_tokens, sibs if m else None)
    stats = StepStats(gamma=gamma, position_accepts=[0] * gamma, drafted=lengths,
                      draft_depth=planner.drafted if planner is not None else max(lengths),
                      draft_s=t1 - t0, verify_s=time.perf_counter() - t1,
                      feed_positions=max(len(r.feed_tokens) for r in rows),
                      siblings=fed.shape[1] - 1 - draft_tokens.shape[1])
    results = []
    for b, r in enumerate(rows):
        k, row_sibs = lengths[b], (sibs[b] if stats.siblings else [])
        n, nxt, j = accept_row(r, draft_tokens[b, :k], q_probs[b], out.logits[b], row_sibs)
        stats.accepted.append(n)
        for i in range(n):
            stats.position_accepts[i] += 1
        if j is None:  # a slice: views, as before siblings existed
            idx, committed = slice(0, n + 1), draft_tokens[b, :n].tolist() + [nxt]
        else:  # the sibling's keys move to where the sequence goes on (its row sits past the chain)
            at = fed.shape[1] - len(row_sibs) + j
            target_cache.move(r.slot, r.t_len + at, r.t_len + 1)
            idx, committed = torch.tensor([0, at]), [row_sibs[j], nxt]
            stats.sibling_accepts += 1
        results.append(RowResult(committed=committed, n_accepted=n, fed_tokens=fed[b, idx],
                                 aux_hidden=out.aux_hidden[b, idx], final_hidden=out.final_hidden[b, idx]))
    return results, stats


def target_step(target: LlamaTarget, cache: KVCache, rows: list[RowInput]) -> list[RowResult]:
    """Target-only decoding (no drafter): one token per row; same commit shape as a spec step."""
    fed = torch.tensor([[r.pending] for r in rows])
    out = target.forward(fed, torch.tensor([r.t_len for r in rows]), cache,
                         torch.tensor([r.slot for r in rows]))
    results = []
    for b, r in enumerate(rows):
        if r.temperature > 0:
            p = filtered_probs(out.logits[b, 0], r.temperature, r.top_p, r.top_k)
            nxt = int(torch.multinomial(p, 1, generator=r.generator))
        else:
            nxt = int(out.logits[b, 0].argmax())
        results.append(RowResult(committed=[nxt], n_accepted=0, fed_tokens=fed[b],
                                 aux_hidden=out.aux_hidden[b], final_hidden=out.final_hidden[b]))
    return results


def prefill(target: LlamaTarget, cache: KVCache, slot: int, prompt_ids: list[int]):
    """Feed a prompt into ``slot``; returns the TargetOutput (logits of the last position only)."""
    ids = torch.tensor([prompt_ids])
    return target.forward(ids, torch.tensor([0]), cache, torch.tensor([slot]), last_only=True)
