"""Speculative decoding is lossless: greedy output equals target-only greedy; sampling keeps p."""
import pytest
import torch
from scipy.stats import chisquare

from tide.spec.decode import accept_sampling, filtered_probs
from tide.spec.generate import generate


def _prompts(vocab: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _assert_same_distribution(spec: dict, plain: dict, n: int) -> None:
    """Chi-square over the tokens both samplers drew often enough: one distribution, not two.
    A token drawn 10 times by both together expects 5 draws from each of two equal-sized samples,
    the test's rule of validity (the rest pooled into one column); at 20 a spread-out distribution
    could leave one token only, and nothing to compare."""
    from scipy.stats import chi2_contingency  # (scipy only for these tests)

    common = [k for k in set(spec) | set(plain) if spec.get(k, 0) + plain.get(k, 0) >= 10]
    table = [[spec.get(k, 0) for k in common] + [n - sum(spec.get(k, 0) for k in common)],
             [plain.get(k, 0) for k in common] + [n - sum(plain.get(k, 0) for k in common)]]
    assert len(common) >= 2, (spec, plain)
    assert chi2_contingency(table).pvalue > 1e-3, table


@pytest.mark.parametrize("gamma,stop_prob", [(1, 0.0), (3, 0.0), (6, 0.0), (4, 0.05), (6, 0.5)])
def test_greedy_identical_to_target_only(tiny_target, tiny_drafter, gamma, stop_prob):
    for prompt in _prompts(tiny_target.shape.vocab_size, 12, seed=gamma):
        ref, _ = generate(tiny_target, None, prompt, 40)
        out, stats = generate(tiny_target, tiny_drafter, prompt, 40, gamma=gamma, stop_prob=stop_prob)
        assert out == ref
        assert stats.target_forwards <= len(ref)


def test_draft_stops_rows_below_the_probability_threshold(tiny_target, tiny_drafter):
    """stop_prob 0 drafts gamma tokens; above every probability, one per row; in between the
    verify is as long as the longest row and shorter rows are never accepted past their length."""
    from tide.spec.decode import RowInput, draft, speculative_step
    from tide.spec.rules import FixedLength, StopRule

    def rows():
        out = []
        tcache = tiny_target.new_cache(3, 128)  # one cache, a slot per prompt
        for slot, prompt in enumerate(_prompts(tiny_target.shape.vocab_size, 3, seed=4)):
            pre = tiny_target.forward(torch.tensor([prompt]), torch.tensor([0]), tcache, torch.tensor([slot]))
            out.append(RowInput(slot=slot, t_len=len(prompt), pending=int(pre.logits[0, -1].argmax()),
                                feed_start=0, feed_tokens=torch.tensor(prompt[1:] + [int(pre.logits[0, -1].argmax())]),
                                feed_aux=pre.aux_hidden[0]))
        return out, tcache

    embed = tiny_target.embed_weight
    r, _ = rows()
    drafts = draft(tiny_drafter, embed, tiny_drafter.new_cache(3, 128), r, 5, StopRule(0.0))
    assert drafts.tokens.shape == (3, 5) and StopRule(0.0).lengths(drafts) == FixedLength().lengths(drafts) == [5] * 3
    assert drafts.prob.shape == (3, 5) and bool(((drafts.prob > 0) & (drafts.prob <= 1)).all())
    drafts = draft(tiny_drafter, embed, tiny_drafter.new_cache(3, 128), r, 5, StopRule(1.01))
    assert drafts.tokens.shape == (3, 1) and StopRule(1.01).lengths(drafts) == [1, 1, 1]
    r, tcache = rows()
    results, stats = speculative_step(tiny_target, tiny_drafter, tcache, tiny_drafter.new_cache(3, 128), r, 5,
                                      StopRule(0.02))
    assert all(1 <= k <= 5 for k in stats.drafted)
    assert all(res.n_accepted <= k for res, k in zip(results, stats.drafted))


def test_greedy_with_an_oracle_like_drafter_accepts_and_stays_identical(tiny_target, tiny_drafter):
    """Force high acceptance: a drafter whose head is the target's own head sees the target's layer
    features; whatever it proposes, output must equal target-only output."""
    prompt = _prompts(tiny_target.shape.vocab_size, 1, seed=9)[0]
    ref, _ = generate(tiny_target, None, prompt, 60)
    out, stats = generate(tiny_target, tiny_drafter, prompt, 60, gamma=4)
    assert out == ref
    assert len(stats.accept_lengths) == stats.target_forwards
    # each step's drafting and verify time is summed (bench/spec_decode prints a step's parts)
    assert stats.draft_s > 0 and stats.verify_s > 0


def test_rejection_sampling_first_token_follows_target():
    g = torch.Generator().manual_seed(0)
    vocab, n = 8, 20000
    target_logits = torch.randn(2, vocab, generator=g) * 1.5
    q = torch.softmax(torch.randn(1, vocab, generator=g) * 2.0, dim=-1)  # a poor drafter
    counts = torch.zeros(vocab)
    for _ in range(n):
        d = torch.multinomial(q[0], 1, generator=g)
        _, tok = accept_sampling(d, q, target_logits, 1.0, 1.0, g)
        accepted = _ == 1
        counts[int(d) if accepted else tok] += 1
    p = filtered_probs(target_logits[0], 1.0, 1.0)
    stat = chisquare(counts.numpy(), (p * n).numpy())
    assert stat.pvalue > 1e-3, (counts / n, p)


def test_rejection_sampling_with_top_p_never_emits_outside_nucleus():
    g = torch.Generator().manual_seed(1)
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0, -2.0]] * 2)
    q = torch.full((1, 5), 0.2)
    p = filtered_probs(logits[0], 1.0, 0.8)
    assert (p[2:] == 0).all()
    seen = torch.zeros(5)
    for _ in range(3000):
        d = torch.multinomial(q[0], 1, generator=g)
        n, tok = accept_sampling(d, q, logits, 1.0, 0.8, g)
        seen[int(d) if n == 1 else tok] += 1
    assert seen[2:].sum() == 0
    stat = chisquare(seen[:2].numpy(), (p[:2] * seen.sum()).numpy())
    assert stat.pvalue > 1e-3


def test_rejection_sampling_with_top_k_follows_the_top_k_distribution():
    g = torch.Generator().manual_seed(2)
    logits = torch.tensor([[3.0, 2.5, 2.0, -1.0, -2.0]] * 2)
    q = torch.full((1, 5), 0.2)  # the drafter proposes outside the top k as often as inside
    p = filtered_probs(logits[0], 1.0, 1.0, top_k=2)
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    seen = torch.zeros(5)
    for _ in range(3000):
        d = torch.multinomial(q[0], 1, generator=g)
        n, tok = accept_sampling(d, q, logits, 1.0, 1.0, g, top_k=2)
        seen[int(d) if n == 1 else tok] += 1
    assert seen[2:].sum() == 0
    stat = chisquare(seen[:2].numpy(), (p[:2] * seen.sum()).numpy())
    assert stat.pvalue > 1e-3


def test_sampled_generation_distribution_matches_target_only(tiny_target, tiny_drafter):
    """End to end on the tiny model: the 2nd generated token (produced by a spec step) has the
    same distribution with and without the drafter (two-sample chi-square, rare tokens pooled)."""
    prompt = [5, 17, 33, 2, 9]
    n = 600
    spec, plain = {}, {}
    for seed in range(n):
        # half the runs stop drafting early on low draft probability: still the target's distribution
        a, _ = generate(tiny_target, tiny_drafter, prompt, 2, gamma=3, temperature=0.4, seed=seed,
                        stop_prob=0.3 if seed % 2 else 0.0)
        b, _ = generate(tiny_target, None, prompt, 2, temperature=0.4, seed=10_000 + seed)
        spec[a[1]] = spec.get(a[1], 0) + 1
        plain[b[1]] = plain.get(b[1], 0) + 1
    _assert_same_distribution(spec, plain, n)


def _cost_engine(tiny_target, tiny_drafter, **kw):
    from costs import linear_cost  # beside this file (pytest puts the folder on sys.path)

    from tide.engine.reference import ReferenceEngine

    # cheap verify tokens: the scheduler drafts, truncates on the live signal, and gates and probes
    return ReferenceEngine(tiny_target, None, tiny_drafter, "v1", target_model_id="tiny", draft_len=4,
                           max_batch_size=4, max_seq_len=200, scheduler="cost", gate_probe_steps=3,
                           cost_model=linear_cost(4, 4, per_token_s=0.04, draft_per_depth_s=0.02), **kw)


def _submit_all(engine, requests):
    import threading

    outs = {}

    def one(req):
        outs[req.request_id] = [t for ev in engine.submit(req) for t in ev.token_ids]
    threads = [threading.Thread(target=one, args=(r,)) for r in requests]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    return [outs[r.request_id] for r in requests]


def test_greedy_identical_to_target_only_with_the_cost_scheduler(tiny_target, tiny_drafter):
    from tide.engine.base import GenerationRequest, SamplingParams

    prompts = _prompts(tiny_target.shape.vocab_size, 10, seed=11)
    engine = _cost_engine(tiny_target, tiny_drafter)
    try:
        reqs = [GenerationRequest(f"g{i}", tuple(p), SamplingParams(max_new_tokens=40),
                                  workload="chat" if i % 2 else "code") for i, p in enumerate(prompts)]
        outs = _submit_all(engine, reqs)
        drafted = engine.stats()
    finally:
        engine.close()
    for p, out in zip(prompts, outs):
        assert out == generate(tiny_target, None, p, 40)[0]
    assert drafted.acceptance["v1"].forwards > 0


def test_sampled_distribution_matches_target_only_with_the_cost_scheduler(tiny_target, tiny_drafter):
    """The 2nd generated token of many seeded requests through the engine with the cost scheduler
    (truncated drafts, rejection sampling) against target-only sampling (two-sample chi-square)."""
    from tide.engine.base import GenerationRequest, SamplingParams

    prompt, n = (5, 17, 33, 2, 9), 600
    engine = _cost_engine(tiny_target, tiny_drafter)
    try:
        reqs = [GenerationRequest(f"s{seed}", prompt, SamplingParams(max_new_tokens=2, temperature=0.4, seed=seed))
                for seed in range(n)]
        spec_outs = []
        for i in range(0, n, 40):
            spec_outs += _submit_all(engine, reqs[i:i + 40])
    finally:
        engine.close()
    spec, plain = {}, {}
    for seed, a in enumerate(spec_outs):
        b, _ = generate(tiny_target, None, list(prompt), 2, temperature=0.4, seed=10_000 + seed)
        spec[a[1]] = spec.get(a[1], 0) + 1
        plain[b[1]] = plain.get(b[1], 0) + 1
    _assert_same_distribution(spec, plain, n)


def test_rejection_sampling_keeps_the_target_distribution_at_depth_2_and_3():
    """Tokens committed from drafts accepted at depth 2 and 3 follow the target. A Markov target
    P[prev, next] and a drafter Q near it (so deep drafts are accepted often) run the step's own
    accept function over a 3-token chain; the committed 2nd and 3rd tokens are tested against
    the target's exact 2- and 3-step marginals (chi-square goodness of fit)."""
    g = torch.Generator().manual_seed(3)
    vocab, n, pending = 6, 30000, 0
    logits = torch.randn(vocab, vocab, generator=g) * 1.5  # target: next-token logits given the previous token
    P = torch.softmax(logits, -1)
    Q = torch.softmax(logits + 0.4 * torch.randn(vocab, vocab, generator=g), -1)  # a close, imperfect drafter
    seen = torch.zeros(2, vocab)
    deep = 0
    for _ in range(n):
        drafts, prev = [], pending
        for _ in range(3):
            prev = int(torch.multinomial(Q[prev], 1, generator=g))
            drafts.append(prev)
        chain = [pending] + drafts  # the target's logits at each verified position follow the chain
        accepted, nxt = accept_sampling(torch.tensor(drafts), Q[chain[:3]], logits[chain], 1.0, 1.0, g)
        committed = drafts[:accepted] + [nxt]
        if len(committed) < 3:  # the step ended early: the next tokens come from the target itself
            prev = committed[-1]
            while len(committed) < 3:
                prev = int(torch.multinomial(P[prev], 1, generator=g))
                committed.append(prev)
        deep += accepted >= 2
        seen[0, committed[1]] += 1
        seen[1, committed[2]] += 1
    assert deep > n // 3, deep  # depth 2 was accepted often: the test covers it
    two = P[pending] @ P  # exact marginal of the 2nd token
    three = two @ P
    for row, want in zip(seen, (two, three)):
        assert chisquare(row.numpy(), (want * n).numpy()).pvalue > 1e-3, (row, want * n)


def test_a_row_near_its_context_end_drafts_beside_a_new_prompts_feed(tiny_target, tiny_drafter):
    """A row one token from its drafter feed's end, batched with a new request's whole prompt feed:
    its padding to the long feed stays inside the drafter cache, and each row drafts what it drafts
    alone (the padding ran past the cache and failed every such drafted step)."""
    import copy

    from tide.spec.decode import RowInput, draft

    max_len, vocab, embed = 64, tiny_target.shape.vocab_size, tiny_target.embed_weight
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (56, 30)]
    tcache, rows = tiny_target.new_cache(2, max_len), []
    for slot, prompt in enumerate(prompts):
        pre = tiny_target.forward(torch.tensor([prompt]), torch.tensor([0]), tcache, torch.tensor([slot]))
        nxt = int(pre.logits[0, -1].argmax())
        rows.append(RowInput(slot=slot, t_len=len(prompt), pending=nxt, feed_start=0,
                             feed_tokens=torch.tensor(prompt[1:] + [nxt]), feed_aux=pre.aux_hidden[0]))
    dcache = tiny_drafter.new_cache(2, max_len)
    head, last = rows[0], len(prompts[0]) - 1  # row 0's feed up to its last position, then that one alone
    draft(tiny_drafter, embed, dcache, [RowInput(0, last, int(head.feed_tokens[-2]), 0, head.feed_tokens[:-1],
                                                 head.feed_aux[:-1])], 1)
    near_end = RowInput(0, head.t_len, head.pending, last, head.feed_tokens[-1:], head.feed_aux[-1:])
    alone = [draft(tiny_drafter, embed, copy.deepcopy(dcache), [row], 3).tokens for row in (near_end, rows[1])]
    together = draft(tiny_drafter, embed, dcache, [near_end, rows[1]], 3).tokens
    assert together.tolist() == [alone[0][0].tolist(), alone[1][0].tolist()]
