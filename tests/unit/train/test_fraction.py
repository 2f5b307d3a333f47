"""How much of a retrain's change a candidate keeps: WiSE-FT's interpolation, and the step-down
while a workload's held-out acceptance falls under its bound (real tiny drafters, trained)."""
import copy
from types import SimpleNamespace

import pytest
import torch

from tests.unit.train.test_trainer import _samples
from tide.train.fraction import fractions_to_try, keep_fraction, keep_update_, short_workloads
from tide.train.trainer import EvalResult, evaluate, train


def test_keep_update_lands_the_given_fraction_of_the_way_from_the_parent(tiny_target, tiny_drafter):
    """train.update_fraction (WiSE-FT): every parameter ends at parent + fraction x (trained - parent);
    the vocab mapping (buffers) is untouched; 1 leaves the trained weights as they are."""
    samples = _samples(tiny_target, n=3)
    trained = copy.deepcopy(tiny_drafter)
    train(trained, tiny_target.embed_weight, tiny_target.lm_head_weight, samples, epochs=3, lr=3e-3,
          batch_tokens=512, max_len=256, ttt_length=2, step_weight=0.8, progress=False)
    kept = copy.deepcopy(trained)
    keep_update_(kept, tiny_drafter, 0.25)
    parent, full = dict(tiny_drafter.named_parameters()), dict(trained.named_parameters())
    moved = 0
    for name, p in kept.named_parameters():
        assert torch.allclose(p, parent[name] + 0.25 * (full[name] - parent[name]), atol=1e-6), name
        moved += not torch.equal(full[name], parent[name])
    assert moved > 0  # training changed something, so the check above could fail
    assert torch.equal(kept.d2t, trained.d2t) and torch.equal(kept.t2d, trained.t2d)
    same = copy.deepcopy(trained)
    keep_update_(same, tiny_drafter, 1.0)
    assert all(torch.equal(p, full[n]) for n, p in same.named_parameters())
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            keep_update_(copy.deepcopy(trained), tiny_drafter, bad)


def test_fractions_step_down_by_a_tenth_to_the_floor():
    assert fractions_to_try(0.6, 0.4) == [0.6, 0.5, 0.4]
    assert fractions_to_try(0.6, 0.45) == [0.6, 0.5, 0.45]
    assert fractions_to_try(1.0, 0.75) == [1.0, 0.9, 0.8, 0.75]
    assert fractions_to_try(0.6, 0.6) == [0.6] and fractions_to_try(0.4, 0.6) == [0.4]  # never above the start


def test_a_workload_is_short_only_when_measured_on_enough_positions():
    parent = EvalResult(2.0, (), 0.0, 0, by_group={"chat": (2.0, 300), "code": (1.5, 900), "few": (2.0, 50)})
    cand = EvalResult(2.2, (), 0.0, 0, by_group={"chat": (1.9, 300), "code": (2.4, 900), "few": (1.0, 50),
                                                  "new": (1.0, 400)})
    assert short_workloads(cand, parent, 0.97, 200) == {"chat": pytest.approx(0.95)}  # code gains; few: 50
    assert short_workloads(cand, parent, 0.94, 200) == {}
    assert short_workloads(cand, parent, 0.97, 10) == {"chat": pytest.approx(0.95), "few": 0.5}


def _old_and_new(tiny_target, tiny_drafter):
    """A parent trained on the old workload, the same trained further on the new one (it loses the old)."""
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    old, new = _samples(tiny_target, n=4, seed=3), _samples(tiny_target, n=4, seed=4)
    kw = dict(epochs=30, lr=3e-3, batch_tokens=512, max_len=256, ttt_length=3, step_weight=0.8, progress=False)
    parent = copy.deepcopy(tiny_drafter)
    train(parent, embed, head, old, **kw)
    trained = copy.deepcopy(parent)
    train(trained, embed, head, new, **kw)
    held, groups = old + new, ["old"] * len(old) + ["new"] * len(new)

    def score(drafter):
        return evaluate(drafter, embed, head, held, gamma=3, groups=groups)
    return parent, trained, score


def test_the_fraction_steps_down_while_the_old_workload_keeps_too_little(tiny_target, tiny_drafter):
    parent, trained, score = _old_and_new(tiny_target, tiny_drafter)
    parent_eval = score(parent)
    tc = SimpleNamespace(update_fraction=1.0, min_update_fraction=0.1, keep_workloads=0.9, keep_min_positions=10)
    given = copy.deepcopy(trained)  # the last fraction tried is applied to the drafter passed in
    whole = keep_fraction(given, parent, score, parent_eval, SimpleNamespace(**{**vars(tc), "keep_workloads": 0.0}))
    assert whole.fraction == 1.0 and len(whole.tried) == 1  # off: the change as trained (rounded to bf16)
    assert whole.drafter is given  # one try: no copy of the drafter
    old_share = whole.evaluation.by_group["old"][0] / parent_eval.by_group["old"][0]
    assert old_share < 0.9, old_share  # training on the new workload lost the old one: the check can fail
    kept = keep_fraction(copy.deepcopy(trained), parent, score, parent_eval, tc)
    assert kept.fraction < 1.0 and [f for f, _ in kept.tried] == fractions_to_try(1.0, 0.1)[:len(kept.tried)]
    assert kept.evaluation.by_group["old"][0] >= 0.9 * parent_eval.by_group["old"][0]  # kept enough
    assert all(short for _, short in kept.tried[:-1]) and kept.tried[-1][1] == {}
    assert kept.evaluation == score(kept.drafter)  # the registered evaluation is of the returned weights
    assert kept.evaluation.by_group["new"][0] > parent_eval.by_group["new"][0]  # still gains on the new
    assert "old" in kept.describe() and "none short" in kept.describe()
    few = keep_fraction(copy.deepcopy(trained), parent, score, parent_eval,
                        SimpleNamespace(**{**vars(tc), "keep_min_positions": 10**6}))
    assert few.fraction == 1.0  # too few positions to steer by: never steps down
