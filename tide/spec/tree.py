"""The smallest draft tree: the chain plus siblings of its first draft.

A row drafts its chain d1..dk as before and also the drafter's next-best alternatives s1..sm to
d1 (its top-(m+1) at depth 1, less d1). Siblings have no children, so the tree costs no extra
drafter step: only ``m`` more query rows in the verify, which the target's row kernel streams the
weights for once anyway up to its pass width (tide/models/llama.py). Why depth 1: that is where a
chain loses most often, and where the drafter's second guess is most often right
(``bench/draft_tree.py`` measures the shapes).

Verify layout, one per step (rows padded alike): ``[pending, d1..dK, s1..sm]``, the chain causal as
before, each sibling at sequence position ``t_len + 1`` attending to the cache and ``pending``
only. Acceptance stays lossless:
- greedy: a rejected d1 whose target token is a sibling accepts that sibling, then the target's
  token after it (from the sibling's own row);
- sampling: after d1's rejection the next token is drawn from the residual r; offering each sibling
  s as a point-mass proposal (accept with probability r(s), else drop s from r and renormalise)
  and drawing from what is left at the end outputs exactly r, so the target's distribution holds.
"""
from __future__ import annotations

import torch


def layout(k: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth [1+k+m], ancestor mask [1+k+m, 1+k+m] bool) of the verify's tokens."""
    q = 1 + k + m
    depth = torch.cat([torch.arange(k + 1), torch.ones(m, dtype=torch.long)])
    mask = torch.ones(q, q, dtype=torch.bool).tril()
    mask[k + 1:, 1:] = False  # a sibling sees only pending (and the cache)...
    idx = torch.arange(k + 1, q)
    mask[idx, idx] = True  # ...and itself
    return depth, mask


def budget(most: int, rows: int, k: int, pass_rows: int) -> int:
    """Siblings per row (at most ``most``) that keep a verify of ``rows`` rows x (1 + k) tokens
    within the passes over the weights its chain needs anyway (``pass_rows`` query rows a pass):
    siblings ride in the room a chain leaves, so they cost attention rows, not weight streaming."""
    chain = rows * (1 + k)
    passes = -(-chain // pass_rows)
    return max(0, min(most, passes * pass_rows // rows - (1 + k)))


def alternatives(scores: torch.Tensor, chosen: int, m: int) -> list[int]:
    """The ``m`` highest-scoring indices other than ``chosen`` (draft-vocab scores [Vd])."""
    top = torch.topk(scores, min(m + 1, scores.numel())).indices.tolist()
    return [i for i in top if i != chosen][:m]


def offer(residual: torch.Tensor, siblings: list[int],
          generator: torch.Generator | None) -> tuple[int | None, torch.Tensor]:
    """Offer each sibling against the residual distribution: (index of the accepted one or None,
    the distribution to draw from when none is: the residual without the refused siblings)."""
    dist = residual
    for j, s in enumerate(siblings):
        u = float(torch.rand((), generator=generator))
        if u < float(dist[s]):
            return j, dist
        rest = dist.clone()
        rest[s] = 0.0
        total = rest.sum()
        if total <= 0:  # dist was all on s (u hit rounding): s is the only outcome left
            return j, dist
        dist = rest / total
    return None, dist
