"""The static recipe's own training ranks: two spawned gloo processes end with the weights one
process reaches by accumulating the same batches per step, and leave no scratch files."""
import copy

import torch

from tests.unit.train.test_trainer import _samples
from tide.train.static_ranks import train_ranked
from tide.train.trainer import train

KWARGS = dict(epochs=2, lr=3e-3, batch_tokens=40, max_len=256, ttt_length=3, step_weight=0.8)


def test_two_spawned_ranks_match_one_process_accumulating_the_same_batches(tiny_target, tiny_drafter, tmp_path):
    samples = _samples(tiny_target, n=8)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    ranked = copy.deepcopy(tiny_drafter)
    got = train_ranked(ranked, embed, head, copy.deepcopy(samples), 2, tmp_path / "scratch", progress=False,
                       **KWARGS)
    single = copy.deepcopy(tiny_drafter)
    want = train(single, embed, head, copy.deepcopy(samples), progress=False, accumulate=2, **KWARGS)
    assert got.steps == want.steps >= 4
    assert got.tokens_seen == want.tokens_seen  # summed over both ranks
    torch.testing.assert_close(got.loss_curve, want.loss_curve, rtol=1e-4, atol=1e-6)
    for name, value in ranked.state_dict().items():
        torch.testing.assert_close(value, single.state_dict()[name], rtol=1e-4, atol=1e-6, msg=name)
    assert not torch.equal(ranked.lm_head.weight, tiny_drafter.lm_head.weight)  # it trained
    assert not (tmp_path / "scratch").exists()


def test_one_rank_trains_in_this_process(tiny_target, tiny_drafter, tmp_path):
    samples = _samples(tiny_target, n=4)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    one = copy.deepcopy(tiny_drafter)
    got = train_ranked(one, embed, head, copy.deepcopy(samples), 1, tmp_path / "scratch", progress=False, **KWARGS)
    want = train(copy.deepcopy(tiny_drafter), embed, head, copy.deepcopy(samples), progress=False, **KWARGS)
    assert got.loss_curve == want.loss_curve
    assert not (tmp_path / "scratch").exists()  # nothing written for one rank
