"""Drafting with the block drafter (tide/drafter/block.py): ``draft``'s contract, two layer passes.

1. the feed, as the chain drafter's first depth: the anchor's hidden state ``h`` [B, 1, H];
2. ``gamma - 1`` mask rows after it in one cached forward: every depth's hidden [B, gamma, H],
   and the base logits of every depth in one head projection;
3. the depths in order, each adding the Markov bias of the token drafted before it (the row's
   pending token before the first): greedy rows take the argmax, sampled rows draw from it at
   their temperature (the q that rejection sampling reads, so verification stays lossless).
The planner does not stop the drafter early (both passes are the cost, whatever the depth); it
still decides how many drafts of each row are verified.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tide.drafter.block import BlockDrafter
from tide.drafter.confidence import Confidence
from tide.models.llama import KVCache
from tide.spec import tree
from tide.spec.decode import Drafts, Planner, RowInput, feed_tensors


def block_draft(drafter: BlockDrafter, embed: torch.Tensor, cache: KVCache, rows: list[RowInput], gamma: int,
                planner: Planner | None = None, head: Confidence | None = None, n_siblings: int = 0) -> Drafts:
    """``gamma`` target-vocab drafts per row (``head`` is ignored: the trial kind has none)."""
    bsz = len(rows)
    tokens, aux, positions, last = feed_tensors(rows, cache.max_len - 1)
    slots = torch.tensor([r.slot for r in rows])
    first = torch.tensor([r.drafter_first_pos for r in rows]) if any(r.drafter_first_pos for r in rows) else None
    d2t_ids = drafter.draft_to_target
    greedy = [r.temperature <= 0 for r in rows]
    q_probs: list[list[torch.Tensor]] = [[] for _ in rows]
    with torch.inference_mode():
        h = drafter.step(F.embedding(tokens, embed), drafter.project(aux), cache, slots, positions, first)
        idx = torch.arange(bsz)
        hidden = drafter.block_hidden(h[idx, last][:, None], cache, slots, positions[idx, last][:, None], gamma, first)
        base = drafter.logits(hidden).float()  # [B, gamma, Vd]

        def pick(k: int, logits: torch.Tensor) -> torch.Tensor:
            choice = logits.argmax(-1)
            for b, r in enumerate(rows):
                if not greedy[b]:
                    q = torch.softmax(logits[b] / r.temperature, dim=-1)
                    choice[b] = int(torch.multinomial(q, 1, generator=r.generator))
                    full = torch.zeros(embed.shape[0])
                    full[d2t_ids] = q
                    q_probs[b].append(full)
            return choice

        logits, choices = drafter.chained_logits(base, tokens[idx, last], d2t_ids, pick)
        probs = torch.softmax(logits, dim=-1)
        prob = probs.gather(-1, choices[..., None])[..., 0]  # [B, gamma]
        for b, r in enumerate(rows):  # a sampled draft's own probability is q at its temperature
            if not greedy[b]:
                prob[b] = torch.stack([q_probs[b][k][d2t_ids[choices[b, k]]] for k in range(gamma)])
        siblings = [d2t_ids[tree.alternatives(logits[b, 0], int(choices[b, 0]), n_siblings)].tolist()
                    if n_siblings > 0 else [] for b in range(bsz)]
    return Drafts(d2t_ids[choices], prob, None, greedy, q_probs, siblings)
