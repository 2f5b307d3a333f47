"""Single-request generation loops over the plain spec functions (tests, benches, evaluation).

The engine runs the same functions batched; this is the unbatched reference:
1. prefill the prompt; the first token comes from the prefill logits;
2. repeat ``speculative_step`` (or ``target_step`` without a drafter) until ``max_new_tokens``
   tokens or a stop token; the drafter's feed is what the previous step committed. Each step's
   planner is the stop rule at ``stop_prob`` (0: every draft), or ``planner()`` when given; the
   drafter's own confidence head serves as it is, and siblings are priced at the row kernel's pass;
   ``drafting`` is the drafter kind's draft function (tide/spec/block.py for the block drafter).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tide.drafter.model import Eagle3Drafter
from tide.models.llama import LlamaTarget
from tide.models.rowkernel import PASS_ROWS
from tide.spec.decode import Planner, RowInput, draft, filtered_probs, prefill, speculative_step, target_step
from tide.spec.rules import StopRule


@dataclass
class GenerationStats:
    target_forwards: int = 0  # decode-phase forwards (prefill excluded)
    tokens: int = 0
    position_accepts: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)  # committed tokens per forward
    sibling_accepts: int = 0  # forwards whose first accepted token was a depth-1 sibling
    draft_s: float = 0.0  # wall seconds drafting, summed over speculative steps
    verify_s: float = 0.0  # ... and in their verify forwards

    @property
    def tokens_per_forward(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))


def generate(target: LlamaTarget, drafter: Eagle3Drafter | None, prompt_ids: list[int],
             max_new_tokens: int, gamma: int = 4, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, stop_ids: tuple[int, ...] = (),
             stop_prob: float = 0.0, siblings: int = 0,
             planner=None, drafting=draft) -> tuple[list[int], GenerationStats]:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    max_len = len(prompt_ids) + max_new_tokens + gamma + siblings + 2
    tcache = target.new_cache(1, max_len)
    dcache = drafter.new_cache(1, max_len) if drafter is not None else None
    out = prefill(target, tcache, 0, prompt_ids)
    if temperature > 0:
        first = int(torch.multinomial(filtered_probs(out.logits[0, -1], temperature, top_p), 1, generator=gen))
    else:
        first = int(out.logits[0, -1].argmax())
    tokens = [first]
    row = RowInput(slot=0, t_len=len(prompt_ids), pending=first, feed_start=0,
                   feed_tokens=torch.tensor(prompt_ids[1:] + [first]), feed_aux=out.aux_hidden[0],
                   temperature=temperature, top_p=top_p, generator=gen)
    stats = GenerationStats(position_accepts=[0] * gamma)
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        if drafter is None:
            (res,) = target_step(target, tcache, [row])
        else:
            plan: Planner = planner() if planner is not None else StopRule(stop_prob)
            (res,), st = speculative_step(target, drafter, tcache, dcache, [row], gamma, plan, drafter.confidence,
                                          siblings, PASS_ROWS, drafting)
            for i, c in enumerate(st.position_accepts):
                stats.position_accepts[i] += c
            stats.sibling_accepts += st.sibling_accepts
            stats.draft_s += st.draft_s
            stats.verify_s += st.verify_s
        stats.target_forwards += 1
        stats.accept_lengths.append(len(res.committed))
        tokens.extend(res.committed)
        row.feed_start, row.t_len = row.t_len, row.t_len + len(res.committed)
        row.pending = res.committed[-1]
        row.feed_tokens = torch.tensor(res.committed)
        row.feed_aux = res.aux_hidden
    for i, t in enumerate(tokens):
        if t in stop_ids:
            tokens = tokens[:i + 1]
            break
    tokens = tokens[:max_new_tokens]
    stats.tokens = len(tokens)
    return tokens, stats
