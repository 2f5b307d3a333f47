"""Depth-1 siblings (tide/spec/tree.py): the verify's tree layout is exact, and speculative decoding
with siblings stays lossless: greedy output equals target-only, sampling keeps the target's
distribution, in single-request generation and through the batched engine."""
import pytest
import torch
from scipy.stats import chisquare
from test_lossless import _assert_same_distribution, _prompts, _submit_all  # beside this file

from tide.spec import tree
from tide.spec.generate import generate


def test_layout_chain_is_causal_and_siblings_see_only_pending_and_themselves():
    depth, mask = tree.layout(3, 2)
    assert depth.tolist() == [0, 1, 2, 3, 1, 1]
    assert mask[:4, :4].equal(torch.ones(4, 4, dtype=torch.bool).tril())
    assert not mask[:4, 4:].any()  # the chain never sees a sibling
    assert mask[4].tolist() == [True, False, False, False, True, False]
    assert mask[5].tolist() == [True, False, False, False, False, True]


def test_siblings_fill_the_room_a_chain_leaves_in_its_weight_passes():
    assert tree.budget(8, rows=1, k=4, pass_rows=6) == 1  # 5 chain rows: one more fits the pass
    assert tree.budget(8, rows=1, k=1, pass_rows=6) == 4
    assert tree.budget(2, rows=1, k=1, pass_rows=6) == 2  # never past the most asked for
    assert tree.budget(8, rows=2, k=1, pass_rows=6) == 1  # 4 rows of 6
    assert tree.budget(8, rows=3, k=1, pass_rows=6) == 0  # the pass is full
    assert tree.budget(8, rows=2, k=4, pass_rows=6) == 1  # 10 rows take 2 passes: 12 rows' room
    assert tree.budget(0, rows=1, k=1, pass_rows=6) == 0


def test_sibling_rows_compute_what_a_chain_with_that_first_draft_computes(tiny_target):
    """The tree forward's sibling rows equal a plain forward of [pending, sibling]; its chain rows
    equal the chain's forward without siblings."""
    prompt = _prompts(tiny_target.shape.vocab_size, 1, seed=3)[0]
    pending, chain, sibs = 7, [11, 12, 13], [21, 22]

    def forward(fed, layout=None):
        cache = tiny_target.new_cache(1, 128)
        tiny_target.forward(torch.tensor([prompt]), torch.tensor([0]), cache, torch.tensor([0]))
        return tiny_target.forward(torch.tensor([fed]), torch.tensor([len(prompt)]), cache, torch.tensor([0]),
                                   tree=layout)
    both = forward([pending, *chain, *sibs], tree.layout(len(chain), len(sibs)))
    alone = forward([pending, *chain])
    assert torch.allclose(both.logits[0, :4], alone.logits[0, :4], atol=1e-5)
    for j, s in enumerate(sibs):
        one = forward([pending, s])
        assert torch.allclose(both.logits[0, 4 + j], one.logits[0, 1], atol=1e-5)
        assert torch.allclose(both.aux_hidden[0, 4 + j], one.aux_hidden[0, 1], atol=1e-5)


def test_offering_siblings_leaves_the_residual_distribution_as_it_was():
    g = torch.Generator().manual_seed(0)
    residual = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    n, seen = 20000, torch.zeros(5)
    for _ in range(n):
        j, dist = tree.offer(residual, [2, 4], g)
        tok = [2, 4][j] if j is not None else int(torch.multinomial(dist, 1, generator=g))
        seen[tok] += 1
    assert chisquare(seen.numpy(), (residual * n).numpy()).pvalue > 1e-3


@pytest.mark.parametrize("siblings,gamma,stop_prob", [(1, 4, 0.3), (3, 1, 0.0), (40, 3, 0.0), (40, 4, 0.5)])
def test_greedy_with_siblings_identical_to_target_only(tiny_target, tiny_drafter, siblings, gamma, stop_prob):
    accepted_siblings = 0
    for prompt in _prompts(tiny_target.shape.vocab_size, 10, seed=gamma + siblings):
        ref, _ = generate(tiny_target, None, prompt, 40)
        out, stats = generate(tiny_target, tiny_drafter, prompt, 40, gamma=gamma, stop_prob=stop_prob,
                              siblings=siblings)
        assert out == ref
        accepted_siblings += stats.sibling_accepts
    if siblings >= 40:  # a third of the draft vocab: rejected first drafts often have the target's token
        assert accepted_siblings > 0


def test_sampled_generation_with_siblings_matches_target_only(tiny_target, tiny_drafter):
    """The 2nd token (after a sibling offer, when d1 is rejected) and the 3rd (from an accepted
    sibling's own row) keep the target's distribution (two-sample chi-square each)."""
    prompt, n = [5, 17, 33, 2, 9], 600
    spec, plain = [{}, {}], [{}, {}]
    offered = 0
    for seed in range(n):
        a, st = generate(tiny_target, tiny_drafter, prompt, 3, gamma=2, temperature=0.4, seed=seed, siblings=24)
        b, _ = generate(tiny_target, None, prompt, 3, temperature=0.4, seed=10_000 + seed)
        offered += st.sibling_accepts
        for i in (0, 1):
            spec[i][a[i + 1]] = spec[i].get(a[i + 1], 0) + 1
            plain[i][b[i + 1]] = plain[i].get(b[i + 1], 0) + 1
    assert offered > 0
    for i in (0, 1):
        _assert_same_distribution(spec[i], plain[i], n)


def test_engine_batches_rows_with_siblings_and_stays_identical(tiny_target, tiny_drafter):
    """Concurrent greedy requests (padded chains, a sibling's keys moved per slot) through the
    reference engine with the stop rule and siblings: each output equals target-only. A wide
    weight pass (injected by the engine) lets many siblings through at batch 4 (the budget is a
    cost rule, not correctness)."""
    from prometheus_client import REGISTRY

    from tide.engine.base import GenerationRequest, SamplingParams
    from tide.engine.reference import ReferenceEngine

    def sibling_accepts() -> float:
        return REGISTRY.get_sample_value("tide_engine_sibling_accepts_total", {"drafter_version": "v1"}) or 0.0

    before = sibling_accepts()
    prompts = _prompts(tiny_target.shape.vocab_size, 8, seed=21)
    engine = ReferenceEngine(tiny_target, None, tiny_drafter, "v1", target_model_id="tiny", draft_len=4,
                             draft_stop_prob=0.3, max_batch_size=4, max_seq_len=200, draft_siblings=5, pass_rows=256)
    try:
        reqs = [GenerationRequest(f"t{i}", tuple(p), SamplingParams(max_new_tokens=40)) for i, p in enumerate(prompts)]
        outs = _submit_all(engine, reqs)
    finally:
        engine.close()
    for p, out in zip(prompts, outs):
        assert out == generate(tiny_target, None, p, 40)[0]
    assert sibling_accepts() > before  # some rows went on from a sibling (its keys moved in their slot)


def test_an_accepted_sibling_s_next_token_comes_from_the_sibling_s_own_row():
    """Sampling, one row, d1 always rejected (the target gives it no mass): the first token keeps the
    target's distribution over the siblings and the rest, and the token after an accepted sibling
    follows that sibling's own verify row (chi-square on each)."""
    from tide.spec.decode import RowInput, accept_row

    g = torch.Generator().manual_seed(1)
    p0 = torch.tensor([0.0, 0.5, 0.3, 0.2, 0.0])  # what the target gives after pending
    after = {1: torch.tensor([0.1, 0.0, 0.0, 0.0, 0.9]), 2: torch.tensor([0.0, 0.0, 0.0, 0.6, 0.4])}
    logits = torch.stack([p0, torch.full((5,), 0.2), after[1], after[2]]).log()  # [pending, d1, s1, s2]
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]])
    row = RowInput(slot=0, t_len=0, pending=0, feed_start=0, feed_tokens=torch.tensor([0]),
                   feed_aux=torch.zeros(1, 3), temperature=1.0, generator=g)
    n_draws, first, nxt = 6000, torch.zeros(5), {1: torch.zeros(5), 2: torch.zeros(5)}
    for _ in range(n_draws):
        n, tok, j = accept_row(row, torch.tensor([0]), q, logits, [1, 2])
        if j is None:
            assert n == 0
            first[tok] += 1
        else:
            assert n == 1
            first[[1, 2][j]] += 1
            nxt[[1, 2][j]][tok] += 1
    assert chisquare(first[1:4].numpy(), (p0[1:4] * n_draws).numpy()).pvalue > 1e-3
    for s in (1, 2):
        support = after[s] > 0
        assert nxt[s][~support].sum() == 0
        assert chisquare(nxt[s][support].numpy(), (after[s][support] * nxt[s].sum()).numpy()).pvalue > 1e-3
