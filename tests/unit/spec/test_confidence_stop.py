"""With ``on_head``, a drafter's calibrated confidence head stops a greedy row once the chain's
survival drops below ``stop_prob`` (the plain rule keeps the draft's own probability), and stays
lossless."""
import copy
import math

import torch

from tide.drafter.confidence import Confidence
from tide.spec.decode import RowInput, draft
from tide.spec.generate import generate
from tide.spec.rules import StopRule


def _with_constant_head(drafter, survival: float, depth: int = 8):
    """A head that predicts the same survival at every depth (zero weights, a fixed bias)."""
    d = copy.deepcopy(drafter)
    d.confidence = Confidence(torch.zeros(2 * d.shape.hidden_size + 1), math.log(survival / (1 - survival)),
                              torch.ones(depth))
    return d


def _rows(target, prompts):
    cache = target.new_cache(len(prompts), 128)
    rows = []
    for slot, prompt in enumerate(prompts):
        pre = target.forward(torch.tensor([prompt]), torch.tensor([0]), cache, torch.tensor([slot]))
        nxt = int(pre.logits[0, -1].argmax())
        rows.append(RowInput(slot=slot, t_len=len(prompt), pending=nxt, feed_start=0,
                             feed_tokens=torch.tensor(prompt[1:] + [nxt]), feed_aux=pre.aux_hidden[0]))
    return rows


def test_rows_stop_when_the_chain_survival_drops_below_the_threshold(tiny_target, tiny_drafter):
    prompts = [[5, 9, 14, 3, 7], [11, 4, 8]]
    embed = tiny_target.embed_weight
    # chain 0.8, 0.64, 0.512 stay >= 0.5; 0.4096 does not: the row stops after its 4th draft
    rule = StopRule(0.5, on_head=True)

    def lengths(d, stop=rule):
        return stop.lengths(draft(d, embed, d.new_cache(2, 128), _rows(tiny_target, prompts), 6, stop, d.confidence))
    assert lengths(_with_constant_head(tiny_drafter, 0.8)) == [4, 4]
    # a confident head drafts the full gamma where the raw top probability would stop early
    assert lengths(_with_constant_head(tiny_drafter, 0.999)) == [6, 6]
    assert max(lengths(tiny_drafter)) < 6  # the tiny random drafter's top probabilities are far below 0.5
    # the plain rule reads the draft's own probability whatever head the drafter carries
    assert lengths(_with_constant_head(tiny_drafter, 0.999), StopRule(0.5)) == lengths(tiny_drafter)


def test_greedy_with_a_head_is_identical_to_target_only(tiny_target, tiny_drafter):
    g = torch.Generator().manual_seed(7)
    head = copy.deepcopy(tiny_drafter)
    h = head.shape.hidden_size
    head.confidence = Confidence(torch.randn(2 * h + 1, generator=g) * 0.3, 0.5, torch.tensor([1.0, 1.5, 2.0]))
    for n in (3, 17, 30):
        prompt = torch.randint(3, tiny_target.shape.vocab_size, (n,), generator=g).tolist()
        ref, _ = generate(tiny_target, None, prompt, 30)
        out, _ = generate(tiny_target, head, prompt, 30, gamma=5, planner=lambda: StopRule(0.3, on_head=True))
        assert out == ref
