"""The step cost model: measured cells, nearest-cell fallback, live running average, the profile."""
import math

import pytest
from prometheus_client import REGISTRY

from tide.spec.cost import CELL_SHARE, StepCostModel, profile


def test_unmeasured_shapes_take_the_nearest_measured_cell_never_a_smaller_one_first():
    cost = StepCostModel(max_rows=4, max_depth=3)
    cost.observe_verify(1, 1, 0.05, live=False)
    cost.observe_verify(4, 4, 0.40, live=False)
    assert cost.verify_s(1, 1) == 0.05
    assert cost.verify_s(4, 3) == 0.40  # one cell from (4, 4), three from (1, 1)
    assert cost.verify_s(9, 9) == 0.40  # clamped to the largest shape the engine runs


def test_a_live_step_moves_its_shape_and_every_shape_of_its_group():
    cost = StepCostModel(max_rows=2, max_depth=2, ewma=0.25)
    cost.observe_verify(2, 3, 1.0, live=False)
    cost.observe_verify(1, 1, 0.5, live=False)
    cost.observe_draft(2, 2, 0.1, live=False)
    cost.observe_verify(2, 3, 2.0)  # twice the figure: the group's speed 1 -> 1.25, the cell's own share after it
    assert cost.verify_s(2, 3) == pytest.approx(1.25 * (1 + 0.25 * CELL_SHARE * (2.0 / 1.25 - 1)))
    assert cost.verify_s(1, 1) == pytest.approx(0.5 * 1.25)  # never timed live: it follows the machine
    assert cost.draft_s(2, 2) == pytest.approx(0.1)  # the drafter's forwards are another group
    assert REGISTRY.get_sample_value("tide_engine_step_cost_speed", {"group": "target"}) == pytest.approx(1.25)
    cost.observe_verify(2, 3, -1.0)  # a nonsense timing is ignored
    assert cost.verify_s(1, 1) == pytest.approx(0.625)
    for _ in range(200):  # a steady timing is the fixed point
        cost.observe_verify(2, 3, 2.0)
    assert cost.verify_s(2, 3) == pytest.approx(2.0, rel=1e-3)


def test_step_costs_count_drafter_time_already_spent():
    cost = StepCostModel(max_rows=1, max_depth=3)
    for q in range(1, 5):
        cost.observe_verify(1, q, 1.0 + 0.1 * (q - 1), live=False)
    for d in range(1, 4):
        cost.observe_draft(1, d, 0.2 * d, live=False)
    assert cost.step_costs(1, 3) == pytest.approx([1.0, 1.3, 1.6, 1.9])
    # two depths drafted: stopping at 0 or 1 still pays for both of them
    assert cost.step_costs(1, 3, drafted=2) == pytest.approx([1.4, 1.5, 1.6, 1.9])


def test_no_drafter_profiled_means_free_drafting_until_measured():
    cost = StepCostModel(max_rows=2, max_depth=2)
    cost.observe_verify(1, 1, 0.1, live=False)
    assert cost.draft_s(2, 2) == 0.0
    cost.observe_draft(2, 2, 0.03)
    assert cost.draft_s(1, 1) == 0.03


def test_empty_model_refuses_to_guess():
    with pytest.raises(RuntimeError, match="profile"):
        StepCostModel(max_rows=1, max_depth=1).verify_s(1, 1)


def test_profile_measures_every_shape_and_exports_it(tiny_target, tiny_drafter):
    from tide.drafter.model import for_serving

    drafter = for_serving(tiny_drafter)
    cost = StepCostModel(max_rows=3, max_depth=2)
    profile(tiny_target, drafter, tiny_target.new_cache(3, 64), drafter.new_cache(3, 64), cost, context_len=20,
            reps=1)
    table = cost.table()
    assert all(v > 0 and math.isfinite(v) for row in table["verify_ms"].values() for v in row)
    assert all(v > 0 for row in table["draft_ms"].values() for v in row)
    got = REGISTRY.get_sample_value("tide_engine_step_cost_seconds", {"kind": "verify", "rows": "3", "tokens": "3"})
    assert got == pytest.approx(cost.verify_s(3, 3))


def _flat(rows: int) -> StepCostModel:
    cost = StepCostModel(max_rows=rows, max_depth=2, ewma=0.5)
    for q in range(1, 4):
        cost.observe_verify(rows, q, 1.0, live=False)
    for d in (1, 2):
        cost.observe_draft(rows, d, 0.1 * d, live=False)
    return cost


def test_step_costs_include_each_kind_of_steps_time_outside_its_forwards():
    cost = _flat(rows=2)  # verify 1.0 s at any width, draft 0.1 s per depth
    assert cost.step_costs(2, 2) == pytest.approx([1.0, 1.1, 1.2])  # nothing measured outside yet
    cost.observe_overhead(2, drafted=False, seconds=0.05)
    # a drafted step's own overhead unknown: it costs at least a target-only step's
    assert cost.step_costs(2, 2) == pytest.approx([1.05, 1.15, 1.25])
    cost.observe_overhead(2, drafted=True, seconds=0.3)
    cost.observe_overhead(2, drafted=True, seconds=0.1)  # running average: 0.3 -> 0.2
    cost.observe_overhead(2, drafted=True, seconds=-1.0)  # timer noise below the forwards: 0 -> 0.1
    assert cost.step_costs(2, 2) == pytest.approx([1.05, 1.2, 1.3])
    assert cost.step_costs(2, 2, drafted=1)[0] == pytest.approx(1.2)  # drafting already happened
    assert cost.table()["overhead_ms"][2] == [50.0, 100.0]
    pinned = StepCostModel(max_rows=1, max_depth=1, ewma=0.0)
    pinned.observe_overhead(1, drafted=True, seconds=5.0)  # a pinned model: live steps never move it
    assert pinned.overhead_s(1, True) == 0.0


def test_a_long_drafter_feed_costs_its_extra_positions_on_drafted_levels_only():
    from tide.spec.cost import STEADY_FEED

    cost = _flat(rows=1)
    assert cost.step_costs(1, 2, feed_positions=40) == pytest.approx([1.0, 1.1, 1.2])  # nothing known yet
    cost.observe_refeed(1, 10, 0.05, live=False)  # 5 ms per position past the steady feed
    assert cost.refeed_s(1, STEADY_FEED) == 0.0 and cost.refeed_s(1, STEADY_FEED + 4) == pytest.approx(0.02)
    # switching drafting on costs the backlog once; target-only does not pay it
    assert cost.step_costs(1, 2, feed_positions=STEADY_FEED + 20) == pytest.approx([1.0, 1.2, 1.3])
    # once drafting has consumed it, every level carries it (spent whatever is kept)
    assert cost.step_costs(1, 2, drafted=1, feed_positions=STEADY_FEED + 20)[0] == pytest.approx(1.2)
    cost.observe_refeed(1, 10, 0.15)  # live: per position 15 ms, running average -> 10 ms
    assert cost.table()["refeed_ms_per_position"][1] == pytest.approx(10.0)


def test_packed_verify_cells_are_interpolated_until_live_steps_measure_them():
    cost = StepCostModel(max_rows=2, max_depth=2, ewma=0.5)
    cost.observe_packed(2, 0, 1.0, live=False)
    cost.observe_packed(2, 4, 2.0, live=False)
    assert cost.packed_costs(2) == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0])
    for tokens in (1, 2, 3):  # no packed cell for one row: a padded verify as deep (an upper bound)
        cost.observe_verify(1, tokens, 0.4 * tokens, live=False)
    assert cost.packed_costs(1) == pytest.approx([0.4, 0.8, 1.2])
    cost.observe_packed(2, 1, 1.1)  # a live step of a shape the profile skipped: its first figure
    assert cost.packed_s(2, 1) == pytest.approx(1.1) and cost.packed_s(2, 2) == pytest.approx(1.4)
    cost.observe_packed(2, 1, 1.3)  # then it moves, and the machine's speed with it (1 -> 1.3 / 1.1 halfway)
    speed = 1 + 0.5 * (1.3 / 1.1 - 1)
    assert cost.packed_s(2, 1) == pytest.approx(speed * (1.1 + 0.5 * CELL_SHARE * (1.3 / speed - 1.1)))
    assert cost.packed_s(2, 0) == pytest.approx(speed) and cost.packed_costs(1)[2] == pytest.approx(1.2 * speed)


def test_a_packed_profile_measures_the_grid_of_total_drafts(tiny_target, tiny_drafter):
    from tide.drafter.model import for_serving

    drafter = for_serving(tiny_drafter)
    cost = StepCostModel(max_rows=3, max_depth=2)
    profile(tiny_target, drafter, tiny_target.new_cache(3, 64), drafter.new_cache(3, 64), cost, context_len=20,
            reps=1, packed=True)
    def measured(rows, drafts):
        return REGISTRY.get_sample_value("tide_engine_step_cost_seconds",
                                         {"kind": "packed", "rows": str(rows), "tokens": str(drafts)})
    for rows, drafts in [(1, 1), (1, 2), (2, 4), (3, 4), (3, 6)]:  # the grid up to each row count's most
        assert measured(rows, drafts) > 0
    assert cost.packed_s(3, 5) == pytest.approx((cost.packed_s(3, 4) + cost.packed_s(3, 6)) / 2)  # off the grid
    for row in cost.table()["packed_verify_ms"].values():
        assert all(v > 0 and math.isfinite(v) for v in row) and row == sorted(row)
    # rows verifying as many drafts each run the padded forward: its grid is timed as well, and a
    # packed step without drafts is its one-token cell, the target-only forward
    def timed(kind, rows, n):
        return REGISTRY.get_sample_value("tide_engine_step_cost_seconds", {"kind": kind, "rows": str(rows),
                                                                           "tokens": str(n)})
    for rows in (1, 2, 3):
        assert timed("packed", rows, 0) == timed("verify", rows, 1)
        assert timed("verify", rows, 2) > 0 and timed("verify", rows, 3) > 0
    assert [timed("packed", 1, k) for k in (1, 2)] == [timed("verify", 1, t) for t in (2, 3)]  # one row: plain


def test_a_packed_profile_times_each_shape_as_a_live_verify_of_it_runs(tiny_target):
    # one row's verify always runs the plain forward (tide/spec/decode.py): timed through the packed
    # path instead, its cells read slower than any step it takes, so its cells are the padded ones;
    # with more rows an even split is timed packed too, as the uneven splits of the same total the
    # admission mostly makes run (the even split itself runs, and is priced as, the padded shape)
    from tide.spec.cost import packed_lengths, profile_shapes

    shapes = profile_shapes(tiny_target, None, tiny_target.new_cache(3, 64), None, max_rows=3, max_depth=2,
                            context_len=20, refeed_positions=8, packed=True, head=None)
    timed = [(rows, drafts, run) for (kind, rows, drafts), run in shapes if kind == "packed"]
    assert {rows for rows, _, _ in timed} == {2, 3}
    for rows, drafts, run in timed:
        lengths = packed_lengths(rows, drafts)
        assert run.args[0].shape == (rows, 1 + max(lengths))
        assert run.keywords["lengths"].tolist() == [n + 1 for n in lengths], (rows, drafts)
    padded = {(rows, tokens) for (kind, rows, tokens), _ in shapes if kind == "verify"}
    assert padded == {(rows, tokens) for rows in (1, 2, 3) for tokens in (1, 2, 3)}


def test_a_packed_cell_timed_above_a_later_one_is_pooled_with_it():
    cost = StepCostModel(max_rows=1, max_depth=4, ewma=0.5)
    for drafts, seconds in [(0, 1.0), (1, 1.6), (2, 1.2), (4, 2.0)]:  # (1, 1.6): another process on the core
        cost.observe_packed(1, drafts, seconds, live=False)
    assert cost.packed_costs(1) == pytest.approx([1.0, 1.4, 1.4, 1.7, 2.0])


def test_a_cell_timed_above_the_same_shape_with_more_rows_is_bounded_by_it():
    # a verify never costs less for carrying more rows: a slow timing of the smaller shape, left
    # as it is, keeps the scheduler off that shape, so no live step ever corrects it
    cost = StepCostModel(max_rows=3, max_depth=2, ewma=0.5)
    for rows, cells in {1: [1.0, 1.1, 1.2], 2: [1.1, 1.2, 3.0, 3.1, 3.2], 3: [1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8]}.items():
        for drafts, seconds in enumerate(cells):
            cost.observe_packed(rows, drafts, seconds, live=False)
    assert cost.packed_costs(2) == pytest.approx([1.1, 1.2, 1.4, 1.5, 1.6])
    assert cost.packed_costs(1) == pytest.approx([1.0, 1.1, 1.2])
    cost.observe_packed(3, 2, 3.4, live=False)  # a new figure of the bound (pooled with its later cells: 2.0)
    assert cost.packed_costs(2) == pytest.approx([1.1, 1.2, 2.0, 2.0, 2.0])
    for rows, tokens, seconds in [(1, 1, 1.0), (1, 2, 2.5), (2, 1, 1.1), (2, 2, 1.3), (2, 3, 1.2)]:
        cost.observe_verify(rows, tokens, seconds, live=False)
    assert cost.verify_s(1, 2) == pytest.approx(1.2)  # (2, 2) bounds it, then (2, 3) bounds that
    assert cost.verify_s(2, 1) == pytest.approx(1.1)


def test_the_profile_keeps_each_shapes_fastest_run_over_passes_of_the_grid():
    import time

    from tide.spec.cost import fastest_over_passes

    calls = []
    def run():  # a slow spell (another process on the core) over three timed runs in a row
        calls.append(1)
        if len(calls) in (3, 4, 5):
            time.sleep(0.03)
    # two shapes, a warm-up pass, then three passes: A B | A B A B A B; the spell hits each shape's
    # runs at most twice of three, where three runs of one shape back to back would all be slow
    assert all(s < 0.015 for s in fastest_over_passes([run, run], reps=3)) and len(calls) == 8


def test_a_target_only_step_is_one_timing_of_both_tables_one_shape():
    cost = StepCostModel(max_rows=2, max_depth=2, ewma=0.5)
    cost.observe_verify(2, 1, 1.0, live=False)
    cost.observe_packed(2, 0, 1.0, live=False)
    cost.observe_target_only(2, 2.0)
    assert cost.verify_s(2, 1) == pytest.approx(cost.packed_s(2, 0))
    # the speed moved once (1 -> 1.5), not once per table
    assert REGISTRY.get_sample_value("tide_engine_step_cost_speed", {"group": "target"}) == pytest.approx(1.5)
