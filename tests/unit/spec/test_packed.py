"""The default scheduler end to end in the reference engine: rows of different draft lengths verified
in one packed forward, greedy output identical to target-only, sampled output distributed as the
target's."""
import copy
import threading

import torch
from costs import linear_cost
from test_lossless import _assert_same_distribution

import tide.engine.reference as reference
from tide.drafter.confidence import Confidence
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine
from tide.spec.generate import generate


def _with_head(drafter, seed: int = 0):
    """The drafter with a calibrated-looking head whose survivals differ by row (random weights):
    the admission then keeps different depths on different rows."""
    d = copy.deepcopy(drafter)
    g = torch.Generator().manual_seed(seed)
    d.confidence = Confidence(torch.randn(2 * d.shape.hidden_size + 1, generator=g) * 0.5, 1.0, torch.ones(4),
                              heldout_ece=0.01)
    return d


def _engine(target, drafter):
    # a verified draft costs a fiftieth of a step: what a row keeps depends on its own survival
    return ReferenceEngine(target, None, drafter, "v1", target_model_id="tiny", draft_len=4, max_batch_size=4,
                           max_seq_len=200, scheduler="dspark",
                           cost_model=linear_cost(4, 4, per_token_s=0.02, draft_per_depth_s=0.01))


def _submit_all(engine, requests):
    outs = {}

    def one(req):
        outs[req.request_id] = [t for ev in engine.submit(req) for t in ev.token_ids]
    threads = [threading.Thread(target=one, args=(r,)) for r in requests]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    return [outs[r.request_id] for r in requests]


def test_greedy_identical_with_different_draft_lengths_per_row_in_one_packed_verify(tiny_target, agreeing_drafter,
                                                                                    monkeypatch):
    drafter, agreeing = agreeing_drafter
    steps = []
    monkeypatch.setattr(reference, "speculative_step", _spy(reference.speculative_step, steps))
    g = torch.Generator().manual_seed(3)
    prompts = agreeing + [torch.randint(3, tiny_target.shape.vocab_size, (9,), generator=g).tolist() for _ in range(4)]
    engine = _engine(tiny_target, _with_head(drafter))
    try:
        assert engine.health()["confidence_head"]["in_use"]
        # two workloads: what the random prompts teach their tracker (drafts rarely accepted) must not
        # depend on which requests the threads got in first, nor decide the agreeing prompts' depths
        outs = _submit_all(engine, [GenerationRequest(f"p{i}", tuple(p), SamplingParams(max_new_tokens=40),
                                                      workload="agreeing" if i < len(agreeing) else "random")
                                    for i, p in enumerate(prompts)])
        accepted = engine.stats().acceptance["v1"]
    finally:
        engine.close()
    for p, out in zip(prompts, outs):
        assert out == generate(tiny_target, None, p, 40)[0]
    mixed = [s for s in steps if s.packed and min(s.drafted) < max(s.drafted) and max(s.drafted) >= 2]
    assert mixed, [s.drafted for s in steps]  # rows of one verify carried different drafts, unpadded
    # and a packed verify accepted deep drafts (which steps mix depths follows the live cost table, so
    # the deep accept is not asked of a mixed step in particular)
    assert accepted.accepted > 0 and any(max(s.accepted) >= 2 for s in steps if s.packed), [s.accepted for s in steps]


def _spy(real, record):
    def spy(*args):
        results, stats = real(*args)
        record.append(stats)
        return results, stats
    return spy


def test_sampled_tokens_follow_the_target_distribution_through_packed_verifies(tiny_target, agreeing_drafter):
    """The 2nd and 3rd tokens of many seeded sampled requests, batched with greedy ones (so rows of a
    verify differ in length), against target-only sampling (two-sample chi-square)."""
    drafter, agreeing = agreeing_drafter
    prompt, n = tuple(agreeing[0][:8]), 480
    engine = _engine(tiny_target, _with_head(drafter, seed=1))
    try:
        spec_outs = []
        for i in range(0, n, 2):
            reqs = [GenerationRequest(f"s{seed}", prompt, SamplingParams(max_new_tokens=3, temperature=0.7, seed=seed))
                    for seed in (i, i + 1)]
            reqs += [GenerationRequest(f"g{i}-{k}", tuple(p), SamplingParams(max_new_tokens=3))
                     for k, p in enumerate(agreeing[1:3])]
            spec_outs += _submit_all(engine, reqs)[:2]
        drafted = engine.stats().acceptance["v1"]
    finally:
        engine.close()
    assert drafted.forwards > 0
    for pos in (1, 2):
        spec, plain = {}, {}
        for seed, a in enumerate(spec_outs):
            b, _ = generate(tiny_target, None, list(prompt), 3, temperature=0.7, seed=10_000 + seed)
            spec[a[pos]] = spec.get(a[pos], 0) + 1
            plain[b[pos]] = plain.get(b[pos], 0) + 1
        _assert_same_distribution(spec, plain, n)
