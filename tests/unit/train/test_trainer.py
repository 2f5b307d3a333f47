"""The trainer learns (simulated acceptance rises on the data it saw) and its evaluation shortcuts
(precomputed target argmax) give the same numbers as the direct computation."""
import copy

import pytest
import torch

from tide.spec.generate import generate
from tide.train.objective import replayed_acceptance, simulated_acceptance
from tide.train.offline import generate_samples
from tide.train.trainer import collate, evaluate, prepare, steps_that_fit, train


def _samples(target, n=6, prompt_len=12, new_tokens=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, target.shape.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(n)]
    return generate_samples(target, prompts, new_tokens, eos_ids=(), batch_size=4, progress=False)


def test_precomputed_target_top_matches_direct_argmax(tiny_target, tiny_drafter):
    samples = _samples(tiny_target, n=3)
    prepare(samples, tiny_drafter, tiny_target.lm_head_weight)
    batch = collate(samples, 256)
    fast = simulated_acceptance(tiny_drafter, tiny_target.embed_weight, tiny_target.lm_head_weight, batch, 3)
    batch.target_top = None
    slow = simulated_acceptance(tiny_drafter, tiny_target.embed_weight, tiny_target.lm_head_weight, batch, 3)
    assert fast == slow


def test_training_raises_simulated_acceptance_and_matches_live_decoding(tiny_target, tiny_drafter):
    samples = _samples(tiny_target)
    drafter = copy.deepcopy(tiny_drafter)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    before = evaluate(drafter, embed, head, samples, gamma=3)
    result = train(drafter, embed, head, samples, epochs=30, lr=3e-3, batch_tokens=512, max_len=256,
                   ttt_length=3, step_weight=0.8, progress=False)
    after = evaluate(drafter, embed, head, samples, gamma=3)
    assert result.steps > 0 and result.loss_curve[-1] < result.loss_curve[0]
    assert after.accept_length > before.accept_length + 0.3, (before, after)
    # the simulation is what live greedy decoding sees on the same sequence (teacher forcing
    # equals the live run while drafts are accepted): compare on the training prompts
    s = samples[0]
    prompt = s.tokens[s.loss_mask == 0].tolist()
    fed = s.tokens[len(prompt):].tolist()  # generated tokens the target was fed (all but the last)
    out, stats = generate(tiny_target, drafter, prompt, 24, gamma=3)
    assert out[:len(fed)] == fed
    assert stats.tokens_per_forward > 1.0
    # stepping the teacher-forced chains as decoding steps them gives decoding's own count, per
    # prompt (the per-position average is another figure: it weighs easy stretches more)
    for s in samples[:3]:
        prompt = s.tokens[s.loss_mask == 0].tolist()
        out, stats = generate(tiny_target, drafter, prompt, 20, gamma=3)
        batch = collate([s], 256)
        tokens, steps = replayed_acceptance(drafter, embed, head, batch, 3, max_tokens=19)
        assert (tokens, steps) == (sum(stats.accept_lengths), stats.target_forwards)
    # the evaluation reports the same replay over every held-out sample, beside the per-position average
    replayed = [replayed_acceptance(drafter, embed, head, collate([s], 256), 3) for s in samples]
    assert after.replayed_accept_length == sum(t for t, _ in replayed) / sum(n for _, n in replayed) > 1.0


def test_wall_time_cap_shrinks_the_schedule_and_stops_annealed(tiny_target, tiny_drafter, monkeypatch):
    """A fake clock ticking 1 s per reading: a 10 s cap leaves room for ~10 steps of the 90
    planned; training stops there with the learning rate at the end of its cosine."""
    import tide.train.trainer as trainer_mod

    ticks = iter(range(10**6))
    monkeypatch.setattr(trainer_mod.time, "monotonic", lambda: float(next(ticks)))
    lrs = []
    real_step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        lrs.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    samples = _samples(tiny_target)
    drafter = copy.deepcopy(tiny_drafter)
    result = train(drafter, tiny_target.embed_weight, tiny_target.lm_head_weight, samples, epochs=30,
                   lr=1e-3, batch_tokens=512, max_len=256, ttt_length=2, step_weight=0.8, progress=False,
                   max_wall_s=10)
    planned = 30 * len(trainer_mod.make_batches(samples, 512, 256))
    assert planned > 20 and 8 <= result.steps <= 12, (planned, result.steps)
    assert lrs[-1] < 0.2 * max(lrs)  # annealed (the floor is 10% of the peak)


def test_wall_time_cap_is_re_estimated_once_steps_settle(tiny_target, tiny_drafter, monkeypatch):
    """Slow first steps (2 s, warm-up) then 1 s steps under a 60 s cap: the estimate after 5 steps
    (30 steps fit) is revised after 20 at the pace since (25 s spent, 1 s a step: 55 fit), so the
    run uses its cap; an average from the start (48 fit) would leave a fifth of it unused."""
    import tide.train.trainer as trainer_mod

    readings = iter(range(10**6))

    def clock() -> float:
        n = next(readings)  # ~one reading per step
        return float(2 * n if n <= 5 else 10 + (n - 5))

    monkeypatch.setattr(trainer_mod.time, "monotonic", clock)
    samples = _samples(tiny_target)
    drafter = copy.deepcopy(tiny_drafter)
    result = train(drafter, tiny_target.embed_weight, tiny_target.lm_head_weight, samples, epochs=100,
                   lr=1e-3, batch_tokens=512, max_len=256, ttt_length=1, step_weight=0.8, progress=False,
                   max_wall_s=60)
    assert 100 * len(trainer_mod.make_batches(samples, 512, 256)) > 60
    assert 53 <= result.steps <= 57, result.steps


def test_steps_that_fit_use_the_pace_since_the_last_estimate():
    assert steps_that_fit(100.0, 20.0, 5, None) == 25  # 4 s a step from the start
    assert steps_that_fit(100.0, 50.0, 20, (5, 20.0)) == 45  # 2 s a step since: 25 more
    assert steps_that_fit(100.0, 120.0, 60, (20, 50.0)) == 60  # over the cap: nothing more


def test_anchor_keeps_a_warm_start_near_its_parent_and_still_learns(tiny_target, tiny_drafter):
    """train.anchor (L2-SP): the same run with a pull toward the starting weights ends closer to
    them than without, and still learns the data."""
    samples = _samples(tiny_target)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    before = evaluate(tiny_drafter, embed, head, samples, gamma=3)
    start = {n: p.detach().clone() for n, p in tiny_drafter.named_parameters()}
    runs = {}
    for anchor in (0.0, 100.0):  # x lr 3e-3: each step takes back 30% of the drift
        drafter = copy.deepcopy(tiny_drafter)
        train(drafter, embed, head, samples, epochs=30, lr=3e-3, batch_tokens=512, max_len=256, ttt_length=3,
              step_weight=0.8, progress=False, anchor=anchor)
        drift = sum(float((p - start[n]).pow(2).sum()) for n, p in drafter.named_parameters()) ** 0.5
        runs[anchor] = (drift, evaluate(drafter, embed, head, samples, gamma=3).accept_length)
    assert runs[100.0][0] < 0.5 * runs[0.0][0], runs
    assert runs[100.0][1] > before.accept_length + 0.1, (before, runs)


def test_anchor_refused_by_the_trainer_outside_its_range(tiny_target, tiny_drafter):
    import pytest

    samples = _samples(tiny_target, n=2)
    for bad in (-1.0, 1000.0):
        with pytest.raises(ValueError, match="anchor"):
            train(copy.deepcopy(tiny_drafter), tiny_target.embed_weight, tiny_target.lm_head_weight, samples,
                  epochs=1, lr=1e-3, batch_tokens=512, max_len=256, ttt_length=1, step_weight=0.8, progress=False,
                  anchor=bad)


def test_evaluation_by_group_gives_each_group_what_it_alone_gives(tiny_target, tiny_drafter):
    seen, unseen = _samples(tiny_target, n=4, seed=0), _samples(tiny_target, n=4, seed=1)
    drafter = copy.deepcopy(tiny_drafter)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    train(drafter, embed, head, seen, epochs=30, lr=3e-3, batch_tokens=512, max_len=256, ttt_length=3,
          step_weight=0.8, progress=False)
    mixed = [s for pair in zip(seen, unseen) for s in pair]  # interleaved: every batch holds both groups
    names = ["seen", "unseen"] * 4
    whole = evaluate(drafter, embed, head, mixed, gamma=3, batch_tokens=160, groups=names)
    alone = {"seen": evaluate(drafter, embed, head, seen, gamma=3), "unseen": evaluate(drafter, embed, head, unseen,
                                                                                        gamma=3)}
    assert set(whole.by_group) == {"seen", "unseen"}
    for name, ev in alone.items():
        acc, positions = whole.by_group[name]
        assert positions == ev.positions
        assert abs(acc - ev.accept_length) < 1e-9
    assert whole.by_group["seen"][0] > whole.by_group["unseen"][0] + 0.3  # the trained group, not swapped
    assert sum(n for _, n in whole.by_group.values()) == whole.positions
    assert evaluate(drafter, embed, head, mixed, gamma=3).by_group == {}  # no groups asked
    with pytest.raises(ValueError, match="3 group names for 8 samples"):
        evaluate(drafter, embed, head, mixed, gamma=3, groups=names[:3])
