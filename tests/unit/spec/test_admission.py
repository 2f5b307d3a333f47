"""DSpark's admission: candidates ranked by survival across rows, the count with the most expected
tokens per second, the decision to draft from recent live chains, probes, and the engine default."""
import pytest
import torch
from costs import linear_cost

from tide.config import ConfigError, load_config
from tide.spec.admission import AdmissionPlan, admit, drafting_gain, survival_of
from tide.spec.cost import StepCostModel
from tide.spec.decode import Drafts, StepStats
from tide.spec.policy import SpecPolicy
from tide.spec.schedule import AcceptanceTracker


def packed_seconds(base=1.0, per_draft=0.1, per_depth=0.01):
    """seconds(k, ran, even) of a packed step: each admitted draft costs the same, wherever it sits
    (an even split too)."""
    return lambda k, ran, even: base + per_draft * k + per_depth * ran


def test_admission_ranks_candidates_across_rows_and_keeps_each_row_a_prefix():
    survival = [[0.9, 0.8, 0.7, 0.1], [0.3, 0.2, 0.1, 0.05], [0.95, 0.5, 0.2, 0.1]]
    # a draft pays where its survival beats the step's tokens/s times its 0.3 s: about 0.45 here
    seconds = packed_seconds(base=3.0, per_draft=0.3, per_depth=0.0)
    lengths, tokens, step_s = admit(survival, [4, 4, 4], seconds)
    assert lengths == [3, 0, 2]  # row 0 to depth 3, row 2 to depth 2, row 1 nothing: not padded alike
    assert tokens == pytest.approx(3 + 0.9 + 0.8 + 0.7 + 0.95 + 0.5) and step_s == pytest.approx(3.0 + 5 * 0.3)
    assert admit(survival, [1, 0, 4], seconds)[0] == [1, 0, 2]  # caps: a token budget, a gated workload


def test_admission_scans_past_a_count_that_does_not_pay_and_drafts_nothing_when_none_does():
    # a staircase: the first draft costs a whole extra pass, the next three ride in it
    stair = lambda k, ran, even: 1.0 if k == 0 else 1.5  # noqa: E731
    assert admit([[0.4, 0.35, 0.3, 0.3]], [4], stair)[0] == [4]  # 2.35 / 1.5 > 1: worth it only as a whole
    assert admit([[0.4, 0.05, 0.0, 0.0]], [4], stair)[0] == [0]
    assert admit([[0.99] * 4] * 2, [4, 4], lambda k, ran, even: 1.0 + 10 * k)[0] == [0, 0]  # too dear at any count


def test_rows_verifying_as_many_drafts_each_are_priced_at_the_plain_forward_they_run():
    # packed, a fourth draft at 0.1 does not pay its 0.1 s; every row verifying one draft runs the
    # plain forward, here as cheap as three drafts packed, so the admission takes the even split
    survival = [[0.9], [0.8], [0.7], [0.1]]
    seconds = lambda k, ran, even: 1.25 if even == 1 else 1.0 + 0.1 * k  # noqa: E731
    assert admit(survival, [1] * 4, seconds)[0] == [1, 1, 1, 1]
    assert admit(survival, [1] * 4, packed_seconds(per_draft=0.1, per_depth=0.0))[0] == [1, 1, 1, 0]
    assert admit(survival, [1, 1, 1, 0], seconds)[0] == [1, 1, 1, 0]  # a row without drafts: packed


def test_survival_is_the_calibrated_live_chain_extended_by_running_acceptance():
    t = AcceptanceTracker(4)
    t.cond = [[800.0, 1000.0], [500.0, 1000.0], [500.0, 1000.0], [500.0, 1000.0]]
    t.calib = [[50.0, 100.0], [50.0, 100.0], [4.0, 4.0], [4.0, 4.0]]  # raw chains twice too confident at depths 1-2
    assert survival_of(t, [0.8, 0.6], 4) == pytest.approx([0.4, 0.3, 0.15, 0.075])
    assert survival_of(t, [0.2, 0.9], 2) == pytest.approx([0.1, 0.1])  # never rises with depth
    assert survival_of(t, None, 3) == pytest.approx([0.8, 0.4, 0.2])  # no live signal: the running rates


def _with_chains(chains, depth=3):
    t = AcceptanceTracker(depth)
    t.cond = [[500.0, 1000.0]] * depth
    for c in chains:
        t.chains.append(c)
    return t


def test_drafting_gain_replays_recent_chains_through_the_admission():
    seconds = packed_seconds(base=1.0, per_draft=0.1, per_depth=0.02)
    confident = _with_chains([[0.95, 0.9, 0.85]] * 8)
    hopeless = _with_chains([[0.01, 0.001, 0.0001]] * 8)
    assert drafting_gain([confident], [3], [True], seconds, 3) > 1.5
    assert drafting_gain([hopeless], [3], [True], seconds, 3) < 1.0  # the drafter's own step is lost
    # a mix: the live signal keeps the confident rows' drafts and drops the rest, so it still pays
    mixed = _with_chains([[0.95, 0.9, 0.85], [0.01, 0.001, 0.0001]] * 4)
    assert drafting_gain([mixed, mixed], [3, 3], [True, True], seconds, 3) > 1.1
    # the newest chains: a drafter that was hopeless a while ago and is confident now pays now
    recovered = _with_chains([[0.01, 0.001, 0.0001]] * 48 + [[0.95, 0.9, 0.85]] * 16)
    assert drafting_gain([recovered], [3], [True], seconds, 3) > 1.5


def test_drafting_gain_pays_the_drafter_the_depths_the_live_plan_would_run():
    # a depth costs 0.3 s: the replay must charge what the step would run, not a depth past it
    seconds = packed_seconds(base=1.0, per_draft=0.1, per_depth=0.3)
    stops = _with_chains([[0.9]] * 4)
    stops.cond = [[500.0, 1000.0], [10.0, 1000.0], [10.0, 1000.0]]  # past depth 1 nothing survives
    # depth 1 admitted, and what depth 1 shows admits nothing deeper: one depth run
    assert drafting_gain([stops], [3], [True], seconds, 3) == pytest.approx((1 + 0.9) / (1.0 + 0.1 + 0.3))
    goes_on = _with_chains([[0.9]] * 4)
    goes_on.cond = [[500.0, 1000.0], [900.0, 1000.0], [10.0, 1000.0]]
    # depth 2 (0.9 x 0.9) pays too: the drafter runs two depths and both are verified
    assert drafting_gain([goes_on], [3], [True], seconds, 3) == pytest.approx((1 + 0.9 + 0.81) / (1.0 + 0.2 + 0.6))


def _drafts(chain_rows, greedy=None):
    probs = torch.tensor(chain_rows)
    return Drafts(torch.zeros_like(probs, dtype=torch.long), probs, None, greedy or [True] * len(chain_rows))


def test_plan_drafts_deeper_only_while_an_admitted_candidate_lies_deeper_then_keeps_each_row_its_own():
    trackers = [_with_chains([], depth=3) for _ in range(2)]
    plan = AdmissionPlan(trackers, [3, 3], [True, True], packed_seconds(base=1.0, per_draft=0.1), 3)
    assert plan.go_on(_drafts([[0.95], [0.05]]))  # row 0's depth 2 (0.95 x 0.5 running) still pays
    assert plan.go_on(_drafts([[0.95, 0.99], [0.05, 0.5]]))
    assert not plan.go_on(_drafts([[0.95, 0.99, 0.2], [0.05, 0.5, 0.5]]))
    assert plan.lengths(_drafts([[0.95, 0.99, 0.2], [0.05, 0.5, 0.5]])) == [2, 0]
    assert plan.drafted == 3 and plan.chosen == [2, 0] and plan.raw_chain[0] == pytest.approx([0.95, 0.9405, 0.1881])


def test_a_probe_row_verifies_one_draft_whatever_the_admission_says():
    trackers = [_with_chains([[0.01, 0.001]], depth=2) for _ in range(2)]
    plan = AdmissionPlan(trackers, [2, 2], [True, True], packed_seconds(), 2, min_lens=[1, 0])
    assert plan.worth_drafting()  # a probe drafts even where drafting does not pay
    assert plan.lengths(_drafts([[0.01, 0.1], [0.01, 0.1]])) == [1, 0]
    assert plan.chosen == [0, 0]  # what the admission chose: what the workload's peek history records
    sampled = AdmissionPlan(trackers, [2, 2], [True, False], packed_seconds(), 2)
    sampled.lengths(_drafts([[0.9, 0.9], [0.9, 0.9]], greedy=[True, False]))
    assert sampled.raw_chain[1] is None  # a sampled row has no live signal: running rates price it


def _policy(**kw):
    return SpecPolicy("dspark", 3, 0.0, linear_cost(4, 3, per_token_s=0.5, draft_per_depth_s=0.1), **kw)


def _step(policy) -> bool:
    """One step of one greedy chat row; a drafted one verifies its one draft, rejected."""
    speculate, plan = policy.plan(["chat"], 3, greedy=[True])
    if speculate:
        plan.raw_chain, plan.drafted, plan.chosen = [[0.01]], 1, [0]
        stats = StepStats(gamma=3, accepted=[0], drafted=[1], draft_depth=1, draft_s=0.1, verify_s=1.5,
                          feed_positions=2, packed=True)
        policy.observe_spec_step(["chat"], stats, plan)
    return speculate


def test_a_starved_workload_probes_often_until_the_drafter_is_judged_then_rarely():
    """Nothing pays at these costs: the workload starves. Until the new drafter has the guard's
    window of verified rows (3 here) every 2nd step probes; from then on every 64th."""
    policy = _policy(judge_rows=3, judge_probe_steps=2)
    policy.drafter_changed("v1")
    assert [_step(policy) for _ in range(6)] == [False, True] * 3
    assert policy.judged_rows == 3 and policy.view()["judged_rows"] == 3
    assert not any(_step(policy) for _ in range(63))
    assert _step(policy)  # the 64th starved step since the last probe
    policy.drafter_changed("v2")  # a new drafter is judged afresh
    assert [_step(policy) for _ in range(2)] == [False, True]


def test_a_probe_step_verifies_a_draft_on_every_row_of_the_starved_workload():
    policy = _policy(judge_rows=100, judge_probe_steps=1)
    policy.drafter_changed("v1")
    speculate, plan = policy.plan(["chat", "chat", "code"], 3, room=[5, 5, 0], greedy=[True, True, True])
    assert speculate and plan.min_lens == [1, 1, 1] and plan.caps == [3, 3, 0]  # no room left: no draft


def test_the_engine_default_is_dspark_with_the_head_and_probes_validated():
    cfg = load_config(env={})
    assert cfg.spec.scheduler == "dspark" and cfg.train.confidence_head and cfg.spec.judge_probe_steps == 4
    with pytest.raises(ConfigError, match="judge_probe_steps"):
        load_config(env={}, overrides={"spec": {"judge_probe_steps": 0}})
    with pytest.raises(ValueError, match="judge_probe_steps"):
        _policy(judge_probe_steps=0)


def test_an_even_packed_step_is_timed_as_the_plain_forward_it_ran():
    cost = StepCostModel(2, 2)
    for tokens in (1, 2, 3):
        cost.observe_verify(2, tokens, 1.0 + 0.2 * (tokens - 1), live=False)
    for drafts in range(5):
        cost.observe_packed(2, drafts, 1.0 + 0.15 * drafts, live=False)
    policy = SpecPolicy("dspark", 2, 0.0, cost)
    seconds = policy._seconds(2, 2, 0)
    assert seconds(2, 1, 1) - seconds(2, 1, 0) == pytest.approx(cost.verify_s(2, 2) - cost.packed_s(2, 2))

    def step(drafted, verify_s):
        policy.observe_spec_step(["chat", "chat"], StepStats(gamma=2, accepted=[0, 0], drafted=drafted, draft_depth=2,
                                                             draft_s=0.1, verify_s=verify_s, feed_positions=2,
                                                             packed=True), None)
    step([1, 1], 2.0)  # one draft each: the plain forward of 2 rows x 2 tokens
    assert cost.verify_s(2, 2) > 1.2 and cost.packed_costs(2)[2] == pytest.approx(1.3 * cost._speed["target"])
    before = cost.verify_s(2, 3)
    step([2, 0], 3.0)  # uneven: the packed forward
    assert cost.packed_costs(2)[2] / cost._speed["target"] > 1.3 and cost.verify_s(2, 3) > before
