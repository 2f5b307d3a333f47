"""DSpark's semi-autoregressive block drafter, on the EAGLE3 drafter's layer (a trial kind).

The chain drafter runs its layer once per draft depth, each depth reading the token it drafted
before. The block drafter runs it twice per step whatever the depth: once over the feed (as the
chain's first depth: target features ``fc(aux)`` and the token that followed) and once over
``gamma - 1`` mask rows (learned ``mask_embed`` and ``mask_hidden`` at the next positions,
causal among themselves, attending the feed's keys), giving every depth's base logits ``U_k``
in one forward. A low-rank Markov head adds what the mask rows cannot see, the token just
before: ``p_k = softmax(U_k + markov_out(markov_in[x_{k-1}]))``. Only that bias is sequential
([rank] x [rank, draft vocab] per depth), so drafting costs two layer passes, not ``gamma``.

Training (tide/train/block_objective.py) teacher-forces ``x_{k-1}`` with the sequence's own
tokens: a greedy verify only ever uses the bias of an accepted prefix, which is those tokens.

Shapes: ``mask_embed``, ``mask_hidden`` [H]; ``markov_in`` [vocab, rank] (indexed by the previous
token's target id: the token before the first draft need not be in the draft vocab);
``markov_out`` [draft vocab, rank]. SGLang and SpecForge load neither these tensors nor this
forward: the kind is a trial until its verdict (docs/benchmarks.md, "Block drafter trial").
"""
from __future__ import annotations

import torch
from torch import nn

from tide.drafter.model import DrafterShape, Eagle3Drafter
from tide.models.llama import KVCache

BLOCK_ARCHITECTURE = "TideBlockDrafter"


class BlockDrafter(Eagle3Drafter):
    def __init__(self, shape: DrafterShape, rank: int = 64):
        super().__init__(shape)
        self.rank = rank
        self.mask_embed = nn.Parameter(torch.zeros(shape.hidden_size))
        self.mask_hidden = nn.Parameter(torch.zeros(shape.hidden_size))
        self.markov_in = nn.Embedding(shape.vocab_size, rank)
        self.markov_out = nn.Linear(rank, shape.draft_vocab_size, bias=False)

    @classmethod
    def from_chain(cls, chain: Eagle3Drafter, rank: int = 64, seed: int = 0) -> "BlockDrafter":
        """A block drafter with ``chain``'s layer, head and vocab; mask rows random, the Markov
        bias zero (it starts as the chain's depth-1 prediction at every depth)."""
        block = cls(chain.shape, rank)
        missing, unexpected = block.load_state_dict(chain.state_dict(), strict=False)
        assert not unexpected and set(missing) <= {"mask_embed", "mask_hidden", "markov_in.weight",
                                                   "markov_out.weight"}, (missing, unexpected)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            block.mask_embed.copy_(torch.randn(chain.shape.hidden_size, generator=g) * 0.02)
            block.mask_hidden.copy_(torch.randn(chain.shape.hidden_size, generator=g) * 0.02)
            block.markov_in.weight.copy_(torch.randn(block.markov_in.weight.shape, generator=g) * 0.02)
            block.markov_out.weight.zero_()
        block.confidence = None
        return block.eval()

    def bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """[..., draft vocab] the Markov head's bias after target-vocab tokens ``prev_ids`` [...]."""
        return self.markov_out(self.markov_in(prev_ids).to(self.markov_out.weight.dtype))

    def mask_rows(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds, hidden) of mask rows, each [*shape, H]."""
        return (self.mask_embed.expand(*shape, -1), self.mask_hidden.expand(*shape, -1))

    @torch.inference_mode()
    def block_hidden(self, h_anchor: torch.Tensor, cache: KVCache, slots: torch.Tensor, anchor_pos: torch.Tensor,
                     gamma: int, first_key: torch.Tensor | None = None) -> torch.Tensor:
        """[B, gamma, H]: the anchor's output ``h_anchor`` [B, 1, H] (from ``step`` over the feed,
        at positions ``anchor_pos`` [B, 1]) and ``gamma - 1`` mask rows after it in one forward.
        The mask rows' keys land in the cache past the anchor, where the next feed overwrites them
        (as the chain's later depths do)."""
        if gamma == 1:
            return h_anchor
        b = h_anchor.shape[0]
        embeds, hidden = self.mask_rows((b, gamma - 1))
        positions = anchor_pos + torch.arange(1, gamma)[None]
        h_mask = self.step(embeds, hidden, cache, slots, positions, first_key)
        return torch.cat((h_anchor, h_mask), dim=1)

    def chained_logits(self, base: torch.Tensor, first_prev: torch.Tensor, d2t: torch.Tensor,
                       pick=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Walk the depths: logits_k = base[:, k] + bias(x_{k-1}); x_k = ``pick``(logits_k) (argmax
        by default; draft-vocab ids). base: [B, D, Vd] float; first_prev: [B] target ids.
        Returns (logits [B, D, Vd], choices [B, D] draft ids)."""
        prev, out, picks = first_prev, [], []
        for k in range(base.shape[1]):
            logits = base[:, k] + self.bias(prev).float()
            choice = logits.argmax(-1) if pick is None else pick(k, logits)
            out.append(logits)
            picks.append(choice)
            prev = d2t[choice]
        return torch.stack(out, 1), torch.stack(picks, 1)

