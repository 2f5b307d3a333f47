"""Speculative speculative decoding (SSD, Saguaro) in the drafter service: while an engine verifies
a row's drafts, pre-draft for the likeliest verify outcomes so the next request finds its drafts
ready (``drafter_service.ssd``; greedy rows; bench/ssd_replay.py is the gate that admitted it).

After drafting a row's chain d1..dD the service keeps, per session, each depth's hidden stream
and logits (``Recorder`` around ``tide.spec.decode.draft``). When it has nothing else to do it
pre-drafts (``predraft``):
1. the outcome probabilities from the chain's top probabilities a_j: P(k accepted) =
   a_1..a_k (1 - a_{k+1}), P(D) = a_1..a_D; ``budget`` speculations spread over the outcomes by a
   capped geometric series (the likeliest k gets the most); a speculation for k is one of the
   drafter's top tokens at depth k+1, less d_{k+1} (a greedy rejection rules it out);
2. every speculation in one batch on scratch cache slots (the session's keys copied in): the bonus
   token fed on the drafter's own hidden stream at depth k (the verify's target states are not
   there yet), then greedy drafts, ``gamma`` deep.
The next request of the session says what happened: its feed is exactly [d1..dk, t*]. A hit
(``lookup``) is answered at once with that speculation's chain cut by the request's stop rule;
then the real feed is written to the session's cache (target states replace the drafter's own)
and the hit chain's keys are copied in, so the next round starts as if drafted normally. A miss
drafts as usual. A swap or a session's end drops its speculations. The engine's verify is
unchanged: the drafts are proposals like any other, so output stays the target's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tide.models.llama import KVCache

FAN_RATIO, FAN_CAP = 0.5, 16


class Recorder:
    """The drafter for one ``draft`` call, keeping each depth's hidden stream [B, 1, H] and logits."""

    def __init__(self, drafter) -> None:
        self._drafter, self.hidden, self.scores = drafter, [], []

    def __getattr__(self, name: str):
        return getattr(self._drafter, name)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self._drafter.logits(hidden)
        self.hidden.append(hidden)
        self.scores.append(out[:, 0].float())
        return out


@dataclass
class Base:
    """What a row's speculations start from: its chain and, per depth, hidden stream and logits."""

    t_len: int
    chain: list[int]
    top: list[float]
    hidden: list[torch.Tensor]  # per depth [1, 1, H]
    scores: list[torch.Tensor]  # per depth [draft vocab]
    specs: dict[tuple[int, int], tuple[list[int], list[float], list[torch.Tensor]]] = field(default_factory=dict)
    done: bool = False  # pre-drafted (or given up on)


def fan_out(probs: list[float], budget: int) -> dict[int, int]:
    """{k: speculations}: a capped geometric series over outcomes by probability, summing to ``budget``."""
    order = sorted(range(len(probs)), key=lambda k: -probs[k])
    best: dict[int, int] = {}
    for f0 in range(1, budget + 1):
        out = {k: min(FAN_CAP, max(1, int(f0 * FAN_RATIO ** i))) for i, k in enumerate(order)}
        if sum(out.values()) > budget:
            break
        best = out
    left = budget - sum(best.values())
    for k in order:
        add = min(left, FAN_CAP - best.get(k, 0))
        best[k] = best.get(k, 0) + add
        left -= add
    return best


def outcomes(base: Base, d2t: torch.Tensor, budget: int) -> list[tuple[int, int]]:
    """The (k, bonus) pairs to pre-draft for, likeliest outcome first."""
    probs, alive = [], 1.0
    for a in base.top:
        probs.append(alive * (1 - a))
        alive *= a
    probs.append(alive)
    out = []
    for k, n in sorted(fan_out(probs, budget).items(), key=lambda kv: -probs[kv[0]]):
        if k >= len(base.scores):
            continue
        ids = d2t[torch.topk(base.scores[k], min(n + 1, base.scores[k].numel())).indices].tolist()
        out += [(k, t) for t in ids if k >= len(base.chain) or t != base.chain[k]][:n]
    return out[:budget]


@torch.inference_mode()
def predraft(drafter, embed: torch.Tensor, cache: KVCache, scratch: KVCache, slot: int, first_pos: int, base: Base,
             gamma: int, budget: int, interrupted) -> None:
    """Fill ``base.specs`` (see the module's steps); stops early, leaving none, when ``interrupted()``."""
    d2t, depth = drafter.draft_to_target, len(base.chain)
    if len(base.hidden) == depth:  # the all-accepted outcome's bonus: one depth past the chain
        pos = torch.tensor([[base.t_len - 1 + depth]])
        h = drafter.step(F.embedding(torch.tensor([[base.chain[-1]]]), embed), base.hidden[-1], cache,
                         torch.tensor([slot]), pos, torch.tensor([first_pos]))
        base.hidden.append(h)
        base.scores.append(drafter.logits(h)[0, 0].float())
    specs = outcomes(base, d2t, min(budget, scratch.num_slots))
    if not specs or interrupted():
        base.done = True
        return
    n, upto = len(specs), base.t_len + depth + 1
    scratch.k[:, :n, :upto] = cache.k[:, slot, :upto]
    scratch.v[:, :n, :upto] = cache.v[:, slot, :upto]
    h = torch.cat([base.hidden[k] for k, _ in specs])
    token = torch.tensor([[t] for _, t in specs])
    pos = torch.tensor([[base.t_len + k] for k, _ in specs])
    slots, first = torch.arange(n), torch.full((n,), first_pos)
    tokens, probs, hidden = [], [], []
    for _ in range(gamma):
        h = drafter.step(F.embedding(token, embed), h, scratch, slots, pos, first)
        p, choice = torch.softmax(drafter.logits(h)[:, 0].float(), -1).max(-1)
        token = d2t[choice][:, None]
        tokens.append(token[:, 0])
        probs.append(p)
        hidden.append(h)
        pos = pos + 1
        if interrupted():
            base.done = True
            return
    tokens_t, probs_t = torch.stack(tokens, 1), torch.stack(probs, 1)
    base.specs = {spec: (tokens_t[j].tolist(), probs_t[j].tolist(), [x[j:j + 1] for x in hidden])
                  for j, spec in enumerate(specs)}
    base.scratch_index = {spec: j for j, spec in enumerate(specs)}
    base.done = True


def lookup(base: Base | None, row: dict, feed_tokens: torch.Tensor, gamma: int, stop: float):
    """The hit for a request's row, or None: (tokens, probs, the speculation's key) cut by the stop rule."""
    if base is None or not base.specs or row["feed_start"] != base.t_len or row["temperature"] > 0:
        return None
    k = row["n_feed"] - 1
    fed = feed_tokens.tolist()
    if k > len(base.chain) or fed[:k] != base.chain[:k]:
        return None
    spec = base.specs.get((k, fed[-1]))
    if spec is None:
        return None
    tokens, probs, _ = spec
    n = 0
    while n < min(gamma, len(tokens)):
        n += 1
        if probs[n - 1] < stop:  # the stop rule: the unsure draft is the last one kept
            break
    return tokens[:n], probs[:n], (k, fed[-1])


@torch.inference_mode()
def settle(drafter, embed: torch.Tensor, cache: KVCache, scratch: KVCache, slot: int, first_pos: int,
           row: dict, feed_tokens: torch.Tensor, feed_aux: torch.Tensor, base: Base, key, kept: int) -> Base:
    """After a hit: the real feed into the session's cache, the hit chain's keys copied in from its
    scratch slot; returns the next round's base (the hit chain's own hidden streams)."""
    t_len, positions = row["t_len"], torch.arange(row["feed_start"], row["t_len"])[None]
    drafter.step(F.embedding(feed_tokens[None], embed), drafter.project(feed_aux[None]), cache,
                 torch.tensor([slot]), positions, torch.tensor([first_pos]))
    j = base.scratch_index[key]
    cache.k[:, slot, t_len:t_len + kept] = scratch.k[:, j, t_len:t_len + kept]
    cache.v[:, slot, t_len:t_len + kept] = scratch.v[:, j, t_len:t_len + kept]
    tokens, probs, hidden = base.specs[key]
    # the first draft followed the bonus token: its hidden stream is the one at depth 0
    return Base(t_len, tokens[:kept], probs[:kept], hidden[:kept],
                [drafter.logits(h)[0, 0].float() for h in hidden[:kept]])
