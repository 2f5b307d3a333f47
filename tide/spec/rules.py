"""The two draft-length rules that need no cost model, as planners for ``tide.spec.decode.draft``.

- ``FixedLength``: every row drafts ``gamma`` and verifies all of it;
- ``StopRule``: a row stops after a draft it is unsure of: below ``stop_prob`` of the draft's own
  probability (greedy rows: the top probability; sampled rows: q(d)), as ``spec.draft_stop_prob``
  says; with ``on_head`` and a confidence head serving, greedy rows stop on the chain's survival
  instead (calibrated, so the product is a probability). Drafting stops once every row has
  stopped. Each row drafts at least one. Why not on the head by default: a chain's survival
  falls below the bar depths earlier than a draft's own probability, which would change every
  stop-rule figure now that drafters carry heads by default.
Both verify padded to the longest kept draft, as the engine always did with them.
"""
from __future__ import annotations

from tide.spec.decode import Drafts


class FixedLength:
    packed = False

    def go_on(self, drafts: Drafts) -> bool:
        return True

    def lengths(self, drafts: Drafts) -> list[int]:
        return [drafts.depth] * drafts.tokens.shape[0]


class StopRule:
    packed = False

    def __init__(self, stop_prob: float, on_head: bool = False) -> None:
        self.stop_prob, self.on_head = stop_prob, on_head

    def _confidence(self, drafts: Drafts):
        """[B, D] what each row's stop is judged on."""
        if drafts.survival is None or not self.on_head:
            return drafts.prob
        chain = drafts.chain()  # the head's: greedy rows
        greedy = chain.new_tensor(drafts.greedy, dtype=chain.dtype)[:, None]
        return greedy * chain + (1 - greedy) * drafts.prob

    def go_on(self, drafts: Drafts) -> bool:
        return bool((self._confidence(drafts) >= self.stop_prob).all(dim=1).any())

    def lengths(self, drafts: Drafts) -> list[int]:
        """1 + the drafts before the row's first unsure one (it is verified too), at most D."""
        sure = (self._confidence(drafts) >= self.stop_prob).long()
        return [min(drafts.depth, 1 + int(n)) for n in sure.cumprod(dim=1).sum(dim=1)]
