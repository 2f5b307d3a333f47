"""Speculative decoding as plain functions: draft, verify, accept. No I/O, no logging, no policy.

State per batch row ``b`` (kept by the engine): the target has cached positions ``0..t_len-1``;
``pending`` is the last committed token, not yet fed to the target; ``feed_*`` are the target
features the drafter has not consumed yet: aux states of positions ``feed_start..t_len-1``, each
paired with the token that followed it (the last pairing is with ``pending``).

One step (``speculative_step``):
1. draft: the drafter consumes the feed (writing its KV cache with target features) and its last
   output proposes d1; then more cached steps on its own hidden stream propose d2.. . ``draft``
   returns a ``Drafts``: the tokens and, per depth, each draft's own probability and (with a
   confidence head) its calibrated survival, as tensors. A ``Planner`` (the step's policy:
   tide/spec/rules.py, schedule.py, admission.py) says after each depth whether to draft on, then
   how many drafts of each row are verified (possibly none);
2. verify: one target forward over ``[pending, d1..dk]`` at positions ``t_len..t_len+k``: padded to
   the longest kept draft, or packed (each row's own length, ``LlamaTarget.forward(lengths=)``) when
   the planner asks for it. On CPU a verify costs more per token fed, so not feeding drafts that
   would be rejected is most of the point;
3. accept: greedy rows keep the longest prefix equal to the target's argmax, then the target's
   token; sampling rows use rejection sampling (accept d with prob min(1, p/q), else resample
   from norm(max(p - q, 0))), which leaves the output distributed exactly as the target's;
   if every draft is accepted the target's next token is the bonus;
4. commit: positions ``t_len..t_len+n_acc`` are now valid in the target cache (rejected ones are
   forgotten by lowering the row's length), and their aux states become the next feed.
Which drafts are verified never changes what is committed beyond how many tokens a step commits
(the accept functions take a prefix of the draft), so every planner is lossless.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from tide.drafter.confidence import Confidence
from tide.drafter.model import Eagle3Drafter
from tide.models.llama import KVCache, LlamaTarget
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
    drafted: list[int] = field(default_factory=list)  # per row: drafts verified (<= gamma)
    draft_depth: int = 0  # depths the drafter ran (its cost), >= the longest kept draft
    draft_s: float = 0.0
    verify_s: float = 0.0
    feed_positions: int = 0  # the longest drafter feed of the step (long after prefill or target-only steps)
    siblings: int = 0  # depth-1 alternatives verified per row (tide/spec/tree.py)
    sibling_accepts: int = 0  # rows whose first accepted token was a sibling
    packed: bool = False  # the verify carried each row's own drafts only (no padding to the longest)

    @property
    def tokens_per_forward(self) -> float:
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))


@dataclass
class Drafts:
    """What one draft pass proposed, as tensors; the step's planner decides what is verified."""

    tokens: torch.Tensor  # [B, D] target-vocab ids; D = the depths the drafter ran
    prob: torch.Tensor  # [B, D] each draft's own probability: greedy rows' top probability
    # (temperature 1), sampled rows' q(d) at the row's temperature
    survival: torch.Tensor | None  # [B, D] the head's calibrated P(draft j survives | drafts < j did); None: no head
    greedy: list[bool]  # per row: greedy (the live signals are for greedy rows only)
    q_probs: list[list[torch.Tensor]] = field(default_factory=list)  # sampled rows: q [V] per depth
    siblings: list[list[int]] = field(default_factory=list)  # per row: depth-1 alternatives (target ids)

    @property
    def depth(self) -> int:
        return self.tokens.shape[1]

    def chain(self) -> torch.Tensor:
        """[B, D] each row's prefix survival signal: the product of the head's survivals when the
        drafter has one (calibrated), else of the top probabilities (raw: over-confident)."""
        return torch.cumprod(self.survival if self.survival is not None else self.prob, dim=1)


class Planner(Protocol):
    """A step's policy over its drafts (tide/spec/rules.py, schedule.py, admission.py)."""

    packed: bool  # verify each row's kept drafts only, not every row padded to the longest

    def go_on(self, drafts: Drafts) -> bool:
        """``drafts.depth`` depths drafted: run the drafter one more depth?"""

    def lengths(self, drafts: Drafts) -> list[int]:
        """How many drafts of each row are verified (<= drafts.depth; 0 = none)."""


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


def feed_tensors(rows: list[RowInput], max_pos: int):
    """The rows' drafter feeds padded to the longest: (tokens, aux, positions, index of each row's last).
    ``max_pos``: the drafter cache's last position, where a row's padding stops."""
    bsz, m = len(rows), max(r.feed_tokens.numel() for r in rows)
    tokens = torch.zeros(bsz, m, dtype=torch.long)
    aux = torch.zeros(bsz, m, rows[0].feed_aux.shape[-1], dtype=rows[0].feed_aux.dtype)
    positions = torch.zeros(bsz, m, dtype=torch.long)
    last = torch.zeros(bsz, dtype=torch.long)
    for b, r in enumerate(rows):
        n = r.feed_tokens.numel()
        tokens[b, :n] = r.feed_tokens
        aux[b, :n] = r.feed_aux
        # padding continues the row's positions, never attended by real queries (causal); a row near
        # the end of its context beside a long feed (a new prompt) would run past the cache: its
        # padding piles up on the cache's last position, beyond any real or drafted token
        positions[b] = (r.feed_start + torch.arange(m)).clamp(max=max_pos)
        last[b] = n - 1
    return tokens, aux, positions, last


def draft(drafter: Eagle3Drafter, embed: torch.Tensor, cache: KVCache, rows: list[RowInput], gamma: int,
          planner: Planner | None = None, head: Confidence | None = None, n_siblings: int = 0) -> Drafts:
    """Propose up to ``gamma`` target-vocab tokens per row, one drafter depth at a time while the
    ``planner`` (None: every depth) asks for more. ``head``: the confidence head whose survivals
    the drafts carry (None: none). With ``n_siblings`` > 0 each row's ``n_siblings`` next-best
    depth-1 tokens come too."""
    bsz = len(rows)
    tokens, aux, positions, last = feed_tensors(rows, cache.max_len - 1)
    slots = torch.tensor([r.slot for r in rows])
    first = torch.tensor([r.drafter_first_pos for r in rows]) if any(r.drafter_first_pos for r in rows) else None
    d2t_ids = drafter.draft_to_target
    vocab = embed.shape[0]
    greedy = [r.temperature <= 0 for r in rows]
    out = torch.zeros(bsz, gamma, dtype=torch.long)
    prob = torch.zeros(bsz, gamma)
    survival = torch.zeros(bsz, gamma) if head is not None else None
    q_probs: list[list[torch.Tensor]] = [[] for _ in rows]
    siblings: list[list[int]] = [[] for _ in rows]
    ran = 0
    with torch.inference_mode():
        hidden = drafter.project(aux)
        h = drafter.step(F.embedding(tokens, embed), hidden, cache, slots, positions, first)
        idx = torch.arange(bsz)
        h = h[idx, last][:, None]  # [B, 1, H]
        pos = positions[idx, last][:, None]
        fed = tokens[idx, last]  # [B] the token each row's next draft follows
        for i in range(gamma):
            logits = drafter.logits(h)[:, 0].float()  # [B, draft_vocab]
            top_p, choice = torch.softmax(logits, dim=-1).max(-1)
            prob[:, i] = top_p
            for b, r in enumerate(rows):
                if not greedy[b]:
                    q = torch.softmax(logits[b] / r.temperature, dim=-1)
                    d = int(torch.multinomial(q, 1, generator=r.generator))
                    full = torch.zeros(vocab)
                    full[d2t_ids] = q
                    q_probs[b].append(full)
                    prob[b, i], choice[b] = q[d], d
                if i == 0 and n_siblings > 0:
                    siblings[b] = d2t_ids[tree.alternatives(logits[b], int(choice[b]), n_siblings)].tolist()
            if survival is not None:
                survival[:, i] = head.survival(h[:, 0], F.embedding(fed, embed), logits, i, drafter.shape.rms_norm_eps)
            out[:, i] = d2t_ids[choice]
            fed, ran = out[:, i], i + 1
            so_far = Drafts(out[:, :ran], prob[:, :ran], None if survival is None else survival[:, :ran], greedy,
                            q_probs, siblings)
            more = planner is None or planner.go_on(so_far)  # asked at every depth: it sees each one
            if ran == gamma or not more:
                break
            pos = pos + 1
            h = drafter.step(F.embedding(out[:, i:i + 1], embed), h, cache, slots, pos, first)
    return so_far


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
           siblings: list[list[int]] | None = None, lengths: list[int] | None = None):
    """One target forward over [pending, d1..dk] (then each row's depth-1 siblings) for every row;
    with ``lengths``, packed: row b's first ``lengths[b]`` drafts only (rows of one length need no
    packing)."""
    parts = [torch.tensor([[r.pending] for r in rows]), draft_tokens]
    layout = None
    if siblings:
        parts.append(torch.tensor(siblings))
        layout = tree.layout(draft_tokens.shape[1], len(siblings[0]))
    fed = torch.cat(parts, dim=1)
    start = torch.tensor([r.t_len for r in rows])
    slots = torch.tensor([r.slot for r in rows])
    return fed, target.forward(fed, start, cache, slots, tree=layout, lengths=packed_forward(lengths))


def packed_forward(lengths: list[int] | None) -> torch.Tensor | None:
    """The ``lengths=`` a verify of rows with ``lengths`` drafts passes the target: [B] tokens per
    row, or None where every row has one length (the plain forward is that shape, and cheaper)."""
    return None if lengths is None or min(lengths) == max(lengths) else torch.tensor(lengths) + 1


def speculative_step(target: LlamaTarget, drafter: Eagle3Drafter, target_cache: KVCache,
                     drafter_cache: KVCache, rows: list[RowInput], gamma: int, planner: Planner,
                     head: Confidence | None = None, siblings: int = 0,
                     pass_rows: int = 1, drafting=draft) -> tuple[list[RowResult], StepStats]:
    """One draft-verify-accept step under ``planner``. ``head``: the confidence head the drafts
    carry survivals from (the engine's choice: a head that failed calibration is not passed).
    ``siblings``: the most depth-1 alternatives verified beside each row's chain
    (tide/spec/tree.py), as many as fit the weight passes the chain's verify makes anyway, a pass
    being ``pass_rows`` query rows (the target's kernel, injected by the engine); none under a
    packed planner. ``drafting``: the drafter kind's draft function (``draft``'s signature; the
    block drafter's is tide/spec/block.py)."""
    n_sib = 0 if planner.packed else siblings
    t0 = time.perf_counter()
    drafts = drafting(drafter, target.embed_weight, drafter_cache, rows, gamma, planner, head, n_sib)
    lengths = [max(0, min(n, drafts.depth)) for n in planner.lengths(drafts)]
    t1 = time.perf_counter()
    k = max(lengths)
    draft_tokens = drafts.tokens[:, :k]
    m = tree.budget(n_sib, len(rows), k, pass_rows) if n_sib and min(lengths) > 0 else 0
    sibs = [s[:m] for s in drafts.siblings] if m else None
    fed, out = verify(target, target_cache, rows, draft_tokens, sibs, lengths if planner.packed else None)
    stats = StepStats(gamma=gamma, position_accepts=[0] * gamma, drafted=lengths, draft_depth=drafts.depth,
                      draft_s=t1 - t0, verify_s=time.perf_counter() - t1,
                      feed_positions=max(len(r.feed_tokens) for r in rows),
                      siblings=fed.shape[1] - 1 - k, packed=planner.packed)
    results = []
    for b, r in enumerate(rows):
        n_b, row_sibs = lengths[b], (sibs[b] if stats.siblings else [])
        q = torch.stack(drafts.q_probs[b][:n_b]) if n_b and drafts.q_probs[b] else None
        n, nxt, j = accept_row(r, draft_tokens[b, :n_b], q, out.logits[b], row_sibs)
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
