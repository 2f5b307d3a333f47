"""The cost scheduler inside the reference engine: target-only steps when drafting cannot pay, the
workload gate off on a drafter that does not pay and back on after a swap, health and metrics."""
import threading

import pytest
import torch
from costs import linear_cost
from prometheus_client import REGISTRY

import tide.engine.reference as reference
from tide.contracts import VersionAcceptance
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine
from tide.spec.generate import generate
from tide.spec.policy import SpecPolicy


def _prompts(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(4, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run(engine, prompts, n, workload):
    outs = {}

    def one(i, p):
        req = GenerationRequest(f"{workload}{i}", tuple(p), SamplingParams(max_new_tokens=n), workload=workload)
        outs[i] = [t for ev in engine.submit(req) for t in ev.token_ids]
    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    return [outs[i] for i in range(len(prompts))]


def test_policy_refuses_an_unknown_scheduler_and_a_cost_scheduler_without_costs():
    with pytest.raises(ValueError, match="scheduler"):
        SpecPolicy("always", 4, 0.3)
    with pytest.raises(ValueError, match="cost model"):
        SpecPolicy("cost", 4, 0.3)


def test_no_drafter_forward_when_verify_cost_exceeds_any_gain(tiny_target, tiny_drafter, monkeypatch):
    calls = []
    real = reference.speculative_step
    monkeypatch.setattr(reference, "speculative_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    # every draft token doubles the step: even certain acceptance (< 1 token each) cannot pay
    steep = linear_cost(4, 3, per_token_s=2.0, draft_per_depth_s=0.5)
    engine = ReferenceEngine(tiny_target, None, tiny_drafter, "v1", target_model_id="tiny", draft_len=3,
                             max_batch_size=4, max_seq_len=200, scheduler="cost", cost_model=steep)
    try:
        before = REGISTRY.get_sample_value("tide_engine_target_only_steps_total", {"reason": "cost"}) or 0
        ps = _prompts(tiny_target.shape.vocab_size, 4, seed=3)
        outs = _run(engine, ps, 20, "chat")
    finally:
        engine.close()
    assert calls == []
    for p, out in zip(ps, outs):
        assert out == generate(tiny_target, None, p, 20)[0]
    after = REGISTRY.get_sample_value("tide_engine_target_only_steps_total", {"reason": "cost"})
    assert after - before >= 19  # every decode step of the 20 tokens but the prefill's
    st = engine.stats()  # steps it did not draft are not the drafter's acceptance (the guard reads it)
    assert st.target_forwards >= 4 * 19 and st.acceptance.get("v1", VersionAcceptance()).forwards == 0


def test_gate_turns_a_workload_off_then_a_swap_turns_it_back_on(tiny_target, tiny_drafter):
    from tide.train.offline import new_drafter

    # one row at a time: a draft pays above ~0.2 acceptance (the prior's 0.6 does, so the engine
    # drafts and measures); the tiny random drafter is far below
    costs = linear_cost(1, 3, per_token_s=0.2, draft_per_depth_s=0.01)
    engine = ReferenceEngine(tiny_target, None, tiny_drafter, "v1", target_model_id="tiny", draft_len=3,
                             max_batch_size=1, max_seq_len=200, scheduler="cost", cost_model=costs,
                             gate_probe_steps=4)
    try:
        ps = _prompts(tiny_target.shape.vocab_size, 6, seed=5)
        outs = _run(engine, ps, 40, "code")
        view = engine.health()
        assert view["speculation"]["code"] == {"on": False, "reason": "acceptance_below_cost"}
        drafted_steps = engine.stats().acceptance["v1"].forwards
        assert 0 < drafted_steps < engine.stats().target_forwards  # gated steps are not draft steps
        assert REGISTRY.get_sample_value("tide_engine_speculation_enabled",
                                         {"workload": "code", "drafter_version": "v1"}) == 0
        engine.swap_drafter(new_drafter(tiny_target, 200, torch.arange(512), seed=5).eval(), "v2")
        more = _run(engine, ps[:1], 2, "code")  # a step applies the swap
        view = engine.health()
        assert view["drafter_version"] == "v2"
        assert view["speculation"]["code"] == {"on": True, "reason": "drafter_swapped"}
        assert REGISTRY.get_sample_value("tide_engine_speculation_enabled",
                                         {"workload": "code", "drafter_version": "v2"}) == 1
        assert REGISTRY.get_sample_value("tide_engine_speculation_gate_changes_total",
                                         {"workload": "code", "drafter_version": "v2",
                                          "reason": "drafter_swapped"}) >= 1
        # the history the demo's report shows: on by default, off once measured, on with v2
        events = view["speculation_events"]
        first_off = next(e for e in events if not e["on"])
        assert events[0] | {"t_unix": 0} == {"t_unix": 0, "workload": "code", "drafter_version": "v1", "on": True,
                                             "reason": "default", "acceptance_by_depth": []}
        assert first_off["reason"] == "acceptance_below_cost" and first_off["drafter_version"] == "v1"
        assert len(first_off["acceptance_by_depth"]) == 3 and first_off["acceptance_by_depth"][0] < 0.6
        assert events[-1]["on"] and events[-1]["reason"] == "drafter_swapped" and events[-1]["drafter_version"] == "v2"
        assert [e["t_unix"] for e in events] == sorted(e["t_unix"] for e in events)
    finally:
        engine.close()
    for p, out in zip(ps, outs):  # probes and deferred drafter feeds kept the output lossless
        assert out == generate(tiny_target, None, p, 40)[0]
    assert more[0] == generate(tiny_target, None, ps[0], 2)[0]


def test_engine_profiles_its_own_step_cost_at_start_up(tiny_target, tiny_drafter):
    engine = ReferenceEngine(tiny_target, None, tiny_drafter, "v1", target_model_id="tiny", draft_len=2,
                             max_batch_size=2, max_seq_len=100, scheduler="cost", profile_context=16)
    try:
        cost = engine.health()["step_cost"]
    finally:
        engine.close()
    assert sorted(cost["verify_ms"]) == [1, 2] and all(len(v) == 3 for v in cost["verify_ms"].values())
    assert all(v > 0 for v in cost["draft_ms"][2])


def test_a_long_feed_step_teaches_the_refeed_cost_not_the_steady_draft_cost():
    from tide.spec.cost import STEADY_FEED, StepCostModel
    from tide.spec.decode import StepStats

    cost = StepCostModel(max_rows=2, max_depth=2, ewma=1.0)  # each live step replaces its cell
    for q in range(1, 4):
        cost.observe_verify(2, q, 1.0, live=False)
    cost.observe_draft(2, 1, 0.1, live=False)
    policy = SpecPolicy("cost", 2, 0.0, cost)
    steady = StepStats(gamma=2, drafted=[1, 1], accepted=[1, 0], draft_depth=1, draft_s=0.12, verify_s=1.0,
                       feed_positions=3)
    policy.observe_spec_step(["chat", "chat"], steady, None)
    assert cost.draft_s(2, 1) == pytest.approx(0.12) and cost.refeed_s(2, 40) == 0.0
    long = StepStats(gamma=2, drafted=[1, 1], accepted=[1, 0], draft_depth=1, draft_s=0.42, verify_s=1.0,
                     feed_positions=STEADY_FEED + 30)
    policy.observe_spec_step(["chat", "chat"], long, None)
    assert cost.draft_s(2, 1) == pytest.approx(0.12)  # the steady cell keeps its figure
    assert cost.refeed_s(2, STEADY_FEED + 30) == pytest.approx(0.30)  # 0.42 - 0.12 over 30 positions


def test_no_draft_past_a_request_s_token_budget():
    # cheap drafts that pay at the prior's acceptance: only the budget limits them
    policy = SpecPolicy("cost", 3, 0.3, linear_cost(2, 3, per_token_s=0.01, draft_per_depth_s=0.001))
    speculate, plan = policy.plan(["chat", "chat"], 3, room=[1, 5])
    assert speculate and plan.caps == [1, 3]  # one draft left for row 0's last two tokens, gamma for row 1
    before = REGISTRY.get_sample_value("tide_engine_target_only_steps_total", {"reason": "cost"}) or 0
    assert policy.plan(["chat", "chat"], 3, room=[0, 0]) == (False, None)  # both rows on their last token
    assert REGISTRY.get_sample_value("tide_engine_target_only_steps_total", {"reason": "cost"}) == before + 1


def test_engine_drafts_nothing_for_a_request_on_its_last_token(tiny_target, tiny_drafter, monkeypatch):
    depths = []
    real = reference.speculative_step

    def spy(*args):
        results, stats = real(*args)
        depths.append(max(stats.drafted))
        return results, stats
    monkeypatch.setattr(reference, "speculative_step", spy)
    cheap = linear_cost(1, 3, per_token_s=0.01, draft_per_depth_s=0.001)  # drafting pays at the prior
    engine = ReferenceEngine(tiny_target, None, tiny_drafter, "v1", target_model_id="tiny", draft_len=3,
                             max_batch_size=1, max_seq_len=200, scheduler="cost", cost_model=cheap)
    try:
        p = _prompts(tiny_target.shape.vocab_size, 1, seed=7)
        out2 = _run(engine, p, 2, "chat")  # the prefill gives token 1: one step left, with room for no draft
        assert depths == []
        out3 = _run(engine, p, 3, "chat")  # two steps' worth: the first may draft one token at most
        assert depths and max(depths) <= 1
    finally:
        engine.close()
    assert out2[0] == generate(tiny_target, None, p[0], 2)[0] and out3[0] == generate(tiny_target, None, p[0], 3)[0]


@pytest.mark.parametrize("scheduler", ["cost", "dspark"])
def test_a_deferred_feed_is_charged_over_the_steps_it_enables(scheduler, monkeypatch):
    """After a run of target-only steps the drafter's feed is long. Charged whole to the next
    drafted step it outweighs a gain that steady drafting pays, every step, while it keeps growing;
    spread over the steps that follow it, drafting resumes. A row about to finish gets no spread."""
    import tide.spec.policy as policy_module
    from tide.spec.cost import STEADY_FEED
    from tide.spec.policy import amortized_feed

    assert amortized_feed(STEADY_FEED + 64, [20, 3]) == STEADY_FEED + 8  # over 8 steps at most
    assert amortized_feed(STEADY_FEED + 64, [1, 1]) == STEADY_FEED + 64  # one step left: all of it
    assert amortized_feed(STEADY_FEED, [20]) == STEADY_FEED
    cost = linear_cost(2, 3, per_token_s=0.05, draft_per_depth_s=0.01)
    cost.observe_refeed(2, 64, 2.0, live=False)  # ~31 ms per deferred position
    feed = STEADY_FEED + 64
    policy = SpecPolicy(scheduler, 3, 0.3, cost)
    assert policy.plan(["chat", "chat"], 3, feed, [20, 20])[0]  # the prior's acceptance pays
    monkeypatch.setattr(policy_module, "REFEED_STEPS", 1)  # charged whole: 2 s on a 1 s step
    assert not SpecPolicy(scheduler, 3, 0.3, cost).plan(["chat", "chat"], 3, feed, [20, 20])[0]


def test_the_realized_rate_counts_a_catch_up_feed_as_the_decision_charges_it():
    """A drafted step after target-only ones feeds the drafter every deferred position. The check of
    what drafting delivers counts that feed spread over the steps it enables, as the decision did:
    counted whole, every sporadic drafted step (a probe) reads as a loss and drafting stays refused."""
    from tide.spec.cost import STEADY_FEED
    from tide.spec.policy import SETTLED_DRAFTS

    cost = linear_cost(2, 3, per_token_s=0.05, draft_per_depth_s=0.01)
    cost.observe_refeed(2, 64, 2.0, live=False)  # 2 s for 64 deferred positions
    policy = SpecPolicy("dspark", 3, 0.3, cost)
    policy._tracker("chat").drafts_seen = SETTLED_DRAFTS  # acceptance learnt: drafted steps count
    assert policy.plan(["chat", "chat"], 3, STEADY_FEED + 64, [20, 20])[0]
    policy.observe_step_wall(2, wall_s=3.2, forwards_s=3.1, drafted=True, tokens=4)
    tokens, seconds, _ = policy.realized.drafted[2]
    # charged 8 of the 64 positions (spread over 8 steps): 2 s x 56/64 is the later steps' share
    assert seconds / tokens == pytest.approx((3.2 - 2.0 * 56 / 64) / 4)
    assert policy.plan(["chat", "chat"], 3, STEADY_FEED, [20, 20])[0]
    policy.observe_step_wall(2, wall_s=1.2, forwards_s=1.1, drafted=True, tokens=4)  # a steady feed: all of it
    assert policy.realized.drafted[2][1] / policy.realized.drafted[2][0] == pytest.approx(
        (0.95 * 0.05 * (3.2 - 1.75) + 0.05 * 1.2) / (0.95 * 0.05 * 4 + 0.05 * 4))


def test_dspark_reuses_a_priced_decision_to_draft_for_a_few_steps_never_across_drafters(monkeypatch):
    """Pricing a decision to draft replays recent chains through the admission: the same question
    (the gate's one-row one, the step's own) is answered again from the last pricing for
    ``REPRICE_STEPS`` steps, then priced anew; a new drafter's decisions never reuse the old one's."""
    import tide.spec.policy as policy_module
    from tide.spec.policy import REPRICE_STEPS

    priced = []
    real = policy_module.drafting_gain
    monkeypatch.setattr(policy_module, "drafting_gain", lambda *args: priced.append(1) or real(*args))
    policy = SpecPolicy("dspark", 3, 0.3, linear_cost(1, 3, per_token_s=0.01, draft_per_depth_s=0.001))
    tracker = policy._tracker("chat")
    tracker.drafts_seen = policy.gate.min_drafts
    for _ in range(REPRICE_STEPS):
        tracker.drafts_seen += 1  # a drafted step moved the acceptance: the gate judges again
        assert policy.plan(["chat"], 3, room=[20])[0]
    assert len(priced) == 2  # the gate's question and the step's, once each
    tracker.drafts_seen += 1
    assert policy.plan(["chat"], 3, room=[20])[0]
    assert len(priced) == 4
    assert policy.plan(["chat"], 3, room=[2])[0]  # another question (row budget): priced at once
    assert len(priced) == 5
    assert policy.plan(["chat"], 2, room=[20])[0]  # the same caps, fewer depths left: another question
    assert len(priced) == 6
    policy.drafter_changed("v2")
    assert policy.plan(["chat"], 3, room=[20])[0]
    assert len(priced) == 7
