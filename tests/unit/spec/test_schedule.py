"""The cost scheduler's decisions: best level, live truncation, running acceptance, the workload gate."""
import random

import pytest

from tide.spec.schedule import (
    CALIB_DECAY,
    PEEK_HISTORY,
    AcceptanceTracker,
    StepPlan,
    WorkloadGate,
    best_level,
    peek_rate,
)


def test_best_level_looks_past_a_level_that_does_not_pay_alone():
    # one row, 0.4 survival at depths 1 and 2; depth 1 costs 0.5 s more, depth 2 only 0.1 s on top
    assert best_level([0.4, 0.4], 1, [1.0, 1.5, 1.6]) == 2  # 1.8 tok / 1.6 s beats 1 tok / 1 s
    assert best_level([0.4, 0.1], 1, [1.0, 1.5, 1.6]) == 0  # 1.5 / 1.6 < 1


def test_best_level_adds_depths_whose_summed_rows_pay_and_stops_where_they_do_not():
    costs = [1.0, 1.2, 1.4, 1.6, 1.8]
    # four rows: depth j is worth sum_b P_b(j) tokens for 0.2 s more
    assert best_level([3.6, 3.0, 0.2, 0.1], 4, costs) == 2
    assert best_level([0.1, 0.05, 0.0, 0.0], 4, costs) == 0  # the same drafts for one row's worth: none
    assert best_level([0.0] * 4, 4, [1.0] * 5) == 0  # free but worthless: the shorter draft


def _tracker(rates):
    t = AcceptanceTracker(len(rates))
    t.cond = [[r * 1000, 1000.0] for r in rates]
    return t


def test_plan_drafts_nothing_before_drafting_when_running_acceptance_does_not_pay():
    plan = StepPlan([_tracker([0.3, 0.3])] * 4, [2] * 4, lambda d: [1.0, 1.6, 2.2], 2)
    assert plan.initial_level() == 0
    cheap = StepPlan([_tracker([0.3, 0.3])] * 4, [2] * 4, lambda d: [1.0, 1.1, 1.2], 2)
    assert cheap.initial_level() == 1  # depth 2 adds 4 x 0.09 tokens for 0.1 s: below 4.7 tok/s


def test_plan_truncates_on_low_live_survival_and_goes_on_on_high():
    costs = lambda drafted: [1.0 + 0.05 * max(0, drafted), 1.2, 1.4, 1.6]  # noqa: E731
    low = StepPlan([_tracker([0.8] * 3)], [3], costs, 3)
    assert low.initial_level() == 3
    assert low.after_depth(1, [0.05]) == 0  # the live signal overrides the running rate: keep none
    high = StepPlan([_tracker([0.8] * 3)], [3], costs, 3)
    high.initial_level()
    assert high.after_depth(1, [0.95]) == 3


def test_gated_rows_add_no_expected_tokens():
    costs = lambda drafted: [1.0, 1.5, 2.0]  # noqa: E731
    rows = [_tracker([0.9, 0.9]), _tracker([0.9, 0.9])]
    assert StepPlan(rows, [2, 2], costs, 2).initial_level() == 2  # 5.42 tok / 2 s > 2 tok / 1 s
    # the second row's workload gated off: the first row's 3.71 tok / 2 s (or 2.9 / 1.5) do not pay
    assert StepPlan(rows, [2, 0], costs, 2).initial_level() == 0


def test_a_probe_verifies_at_least_one_draft_even_when_it_does_not_pay():
    plan = StepPlan([_tracker([0.1, 0.1])], [2], lambda d: [1.0, 2.0, 3.0], 2, min_level=1)
    assert plan.initial_level() == 1


def test_tracker_counts_a_depth_as_a_trial_only_after_the_depth_before_survived():
    t = AcceptanceTracker(3)
    before = [list(c) for c in t.cond]
    t.observe(drafted=3, accepted=1, raw_chain=[0.9, 0.5, 0.2])
    keep = 0.98
    assert t.cond[0] == pytest.approx([before[0][0] * keep + 1, before[0][1] * keep + 1])  # accepted
    assert t.cond[1] == pytest.approx([before[1][0] * keep, before[1][1] * keep + 1])  # rejected
    assert t.cond[2] == pytest.approx(before[2])  # never reached
    # calibration: observed accepts against predicted survival, at every drafted depth
    slow = 1 - CALIB_DECAY
    assert t.calib[1] == pytest.approx([4.0 * slow, 4.0 * slow + 0.5])


def test_tracker_calibration_scales_an_overconfident_signal_down():
    t = AcceptanceTracker(1)
    for _ in range(300):
        t.observe(1, 0, [0.9])  # predicted 0.9, never accepted
    assert t.calibrate(1, 0.9) < 0.05
    assert t.survival()[0] < 0.05


def test_a_calibrated_signal_keeps_its_calibration_near_one_in_nearly_every_history():
    # what admission decides on is chain x calibration; a history that happens to read the ratio
    # low drafts less and so corrects it less often (a drafter stuck at 0.8 of its true acceptance
    # drafted a third of the steps a paying load wanted): the ratio must not wander that far on
    # noise alone. Accepts here are drawn at exactly the predicted survival.
    rng = random.Random(7)
    ratios = []
    for _ in range(300):
        t = AcceptanceTracker(1)
        for _ in range(600):
            raw = rng.uniform(0.2, 1.0)
            t.observe(1, int(rng.random() < raw), [raw])
        ratios.append(t.calibrate(1, 0.5) / 0.5)
    ratios.sort()
    assert ratios[7] > 0.9 and ratios[-8] < 1.1  # the central 95%


def test_gate_switches_a_workload_off_probes_it_and_resets_on_a_new_drafter():
    gate = WorkloadGate(probe_steps=3, min_drafts=4)
    solo = lambda ran: [1.0, 1.3, 1.6]  # noqa: E731  one row: a draft pays above 0.3 survival
    bad = _tracker([0.1, 0.1])
    assert gate.decide("code", bad, solo) == (True, False, None)  # too few drafts seen to judge
    bad.drafts_seen = 4
    assert gate.decide("code", bad, solo) == (False, False, "acceptance_below_cost")
    assert gate.decide("code", bad, solo)[:2] == (False, False)
    assert gate.decide("code", bad, solo)[:2] == (False, True)  # every 3rd step of the workload
    good = _tracker([0.8, 0.8])
    good.drafts_seen = 4
    assert gate.decide("chat", good, solo) == (True, False, None)
    assert gate.reset("drafter_swapped") == [("code", True, "drafter_swapped")]
    assert gate.state["code"]["on"] and gate.state["code"]["reason"] == "drafter_swapped"
    assert gate.decide("code", good, solo) == (True, False, None)


def test_gate_reopens_only_past_a_higher_bar_than_it_closes_at():
    gate = WorkloadGate(probe_steps=100, min_drafts=4)
    solo = lambda ran: [1.0, 1.3, 1.6]  # noqa: E731  one row: a draft pays above 0.3 survival, plus the margin
    edge = _tracker([0.345, 0.0])  # pays by MIN_GAIN (1.345 / 1.3 = 1.035) but not by REOPEN_GAIN
    edge.drafts_seen = 4
    assert gate.decide("code", edge, solo)[0]  # on: stays on
    bad = _tracker([0.2, 0.0])
    bad.drafts_seen = 4
    assert gate.decide("code", bad, solo)[0] is False
    assert gate.decide("code", edge, solo)[0] is False  # off: the same rates do not switch it back
    good = _tracker([0.5, 0.0])
    good.drafts_seen = 4
    assert gate.decide("code", good, solo)[::2] == (True, "acceptance_pays")


def _peeked(rates, outcomes):
    t = _tracker(rates)
    for kept, accepted in outcomes:
        t.remember(kept, accepted)
    t.drafts_seen = len(outcomes)
    return t


def test_peek_rate_prices_what_the_live_signal_keeps():
    # one row, depth 2; a draft kept to L ran L+1 depths: 0.1 s per drafted depth, 0.5 s per kept draft
    cost_at = lambda ran: [1.0 + 0.1 * ran + 0.5 * m for m in range(3)]  # noqa: E731
    t = _peeked([0.2, 0.2], [(0, 0)] * 3 + [(1, 1)])  # a quarter of peeks keep one draft, accepted
    # tokens 1 + 1/4; seconds 3/4 * 1.1 (kept none after one depth) + 1/4 * 1.7 (kept 1 after two)
    assert peek_rate([t], [2], cost_at) == pytest.approx(1.25 / (0.75 * 1.1 + 0.25 * 1.7))
    assert peek_rate([t, _tracker([0.2, 0.2])], [2, 2], cost_at) is None  # a row with no outcomes yet
    # two rows: the step keeps the longer of the two drafts; P(longest = 0) = (3/4)^2
    two = peek_rate([t, t], [2, 2], cost_at)
    assert two == pytest.approx(2.5 / (0.5625 * 1.1 + 0.4375 * 1.7))
    # a row whose workload is off adds no tokens and keeps nothing
    assert peek_rate([t, t], [2, 0], cost_at) == pytest.approx(2.25 / (0.75 * 1.1 + 0.25 * 1.7))


def test_plan_peeks_where_average_acceptance_does_not_pay_but_kept_drafts_do():
    cost_at = lambda ran: [1.0 + 0.02 * ran + 0.3 * m for m in range(3)]  # noqa: E731
    poor = [0.15, 0.1]  # 1.15 tokens for 1.32 s: drafting every step does not pay
    confident = _peeked(poor, [(0, 0)] * 3 + [(2, 2)])  # but a quarter of peeks keep 2 drafts, both accepted
    plan = StepPlan([confident], [2], cost_at, 2)
    assert plan.initial_level() == 1  # run the drafter: the live signal decides
    assert plan.after_depth(1, [0.05]) == 0  # an unconfident draft is not verified
    hopeless = _peeked(poor, [(1, 0)] * 4)  # kept drafts that are rejected: no peek either
    assert StepPlan([hopeless], [2], cost_at, 2).initial_level() == 0
    assert StepPlan([_tracker(poor)], [2], cost_at, 2).initial_level() == 0  # no outcomes yet: averages decide


def test_gate_keeps_a_workload_on_whose_peeks_pay():
    gate = WorkloadGate(probe_steps=100, min_drafts=4)
    cost_at = lambda ran: [1.0 + 0.02 * ran + 0.3 * m for m in range(3)]  # noqa: E731
    assert gate.decide("korean", _peeked([0.15, 0.1], [(0, 0)] * 3 + [(2, 2)]), cost_at)[0]
    assert not gate.decide("korean", _peeked([0.15, 0.1], [(1, 0)] * 4), cost_at)[0]


def test_tracker_records_the_chosen_depth_of_a_probe_not_its_forced_one():
    t = AcceptanceTracker(3)
    t.observe(drafted=1, accepted=1, raw_chain=[0.1], ran=1, chosen=0)  # a probe forced one draft
    t.observe(drafted=2, accepted=1, raw_chain=[0.9, 0.6], ran=3, chosen=2)
    t.observe(drafted=2, accepted=2, raw_chain=None, ran=2)  # a sampled row: no live signal to price
    assert list(t.kept) == [(0, 0), (2, 1)]
    for i in range(PEEK_HISTORY):  # the oldest outcomes leave the counts as they leave the history
        t.remember(3, i % 2)
    assert t.kept_counts[0][0] == t.kept_counts[2][1] == 0
    assert t.kept_counts[3][0] + t.kept_counts[3][1] == PEEK_HISTORY == len(t.kept)
    assert t.peek_summary(3, 3) == (pytest.approx(0.5), [0.0, 0.0, 0.0, 1.0])
    assert t.peek_summary(1, 3) == (pytest.approx(0.5), [0.0, 1.0, 1.0, 1.0])  # a budget of one draft


def test_gate_refuses_a_zero_probe_interval():
    with pytest.raises(ValueError, match="gate_probe_steps"):
        WorkloadGate(0)


def test_realized_rate_stops_drafting_where_drafted_steps_delivered_less_and_probes():
    from tide.spec.schedule import RealizedRate

    rr = RealizedRate(probe_steps=5)
    for _ in range(RealizedRate.MIN_STEPS - 1):
        rr.observe(4, tokens=5, wall_s=0.5)  # 10 tok/s drafted
    assert rr.allows(4, lambda n: 0.25)  # not enough drafted steps to judge yet
    rr.observe(4, tokens=5, wall_s=0.5)
    assert rr.tokens_per_s(4) == pytest.approx(10.0)
    # a target-only step of 4 rows in 0.25 s is 16 tok/s: drafting is refused, bar one probe in 5
    assert [rr.allows(4, lambda n: 0.25) for _ in range(10)] == [False] * 4 + [True] + [False] * 4 + [True]
    assert rr.allows(4, lambda n: 0.392)  # 10.2 tok/s, within 2%: drafting is kept
    assert rr.allows(4, lambda n: 0.6)  # 6.7 tok/s target-only: drafting delivers more
    assert rr.allows(2, lambda n: 0.01)  # fewer rows: a refusal at 4 says nothing about 2


def test_realized_rate_does_not_let_its_first_step_dominate_the_figure():
    # the first drafted step at a new load feeds the drafter every new prompt: slow and unusual
    from tide.spec.schedule import RealizedRate

    rr = RealizedRate(probe_steps=5)
    rr.observe(4, tokens=5, wall_s=2.0)
    for _ in range(RealizedRate.MIN_STEPS - 1):
        rr.observe(4, tokens=5, wall_s=0.5)  # 10 tok/s from then on
    assert rr.tokens_per_s(4) > 8.5  # one step in 16, near its share; seeded with it, the figure read 4.2
    assert rr.allows(4, lambda n: 0.5)  # 8 tok/s target-only: drafting delivers more


def test_realized_rate_refusal_at_fewer_rows_holds_where_a_row_count_has_no_figure():
    from tide.spec.schedule import RealizedRate

    rr = RealizedRate(probe_steps=3)
    for _ in range(RealizedRate.MIN_STEPS):
        rr.observe(4, tokens=5, wall_s=0.5)  # 10 tok/s drafted at 4 rows
    slower = {4: 0.25, 7: 0.4}  # target-only 16 tok/s at 4 rows: drafting refused there
    assert [rr.allows(7, slower.get) for _ in range(3)] == [False, False, True]  # a batch's tail, probed too
    assert rr.allows(7, {4: 0.6, 7: 0.4}.get)  # where drafting at 4 rows paid, 7 rows are not refused
    for _ in range(RealizedRate.MIN_STEPS):
        rr.observe(7, tokens=10, wall_s=0.5)  # 20 tok/s drafted: 7 rows' own figure decides from now on
    assert rr.allows(7, slower.get)
