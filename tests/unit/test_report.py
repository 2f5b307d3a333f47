"""The comparison's per-prompt bookkeeping and its paired bootstrap interval."""
import pytest

from tide.report import ModeResult, ratio_interval


def _mode(per_prompt: list[tuple[int, int]]) -> ModeResult:
    """(committed, forwards) per prompt; tokens/s mirrors tokens per forward (1 s per forward)."""
    m = ModeResult()
    for committed, forwards in per_prompt:
        m.add(tokens=committed, decode_s=float(forwards), forwards=forwards, committed=committed)
    return m


def test_add_keeps_totals_and_per_prompt_figures():
    m = _mode([(30, 20), (10, 10)])
    assert (m.prompts, m.committed, m.forwards) == (2, 40, 30)
    assert m.prompt_committed == [30, 10] and m.prompt_forwards == [20, 10]
    assert m.tokens_per_forward == pytest.approx(40 / 30)


def test_interval_is_a_point_when_every_prompt_has_the_same_ratio():
    a = _mode([(30, 20), (60, 40), (15, 10)])  # 1.5 everywhere
    b = _mode([(20, 20), (40, 40), (10, 10)])  # 1.0 everywhere
    lo, hi = ratio_interval(a, b, "tokens_per_forward")
    assert lo == pytest.approx(1.5) and hi == pytest.approx(1.5)


def test_interval_brackets_the_ratio_and_widens_with_spread():
    b = _mode([(20, 20)] * 8)
    tight = _mode([(29, 20), (31, 20)] * 4)
    spread = _mode([(22, 20), (38, 20)] * 4)
    lo_t, hi_t = ratio_interval(tight, b, "tokens_per_forward")
    lo_s, hi_s = ratio_interval(spread, b, "tokens_per_forward")
    assert lo_t < 1.5 < hi_t and lo_s < 1.5 < hi_s
    assert hi_s - lo_s > 3 * (hi_t - lo_t)
    assert ratio_interval(spread, b, "tokens_per_s") == (lo_s, hi_s)  # same figures by construction


def test_interval_is_nan_when_the_baseline_decoded_nothing():
    lo, hi = ratio_interval(_mode([(2, 1)]), _mode([(0, 1)]), "tokens_per_forward")
    assert lo != lo and hi != hi  # NaN


def test_interval_refuses_unpaired_modes_and_unknown_metrics():
    with pytest.raises(ValueError, match="same prompts"):
        ratio_interval(_mode([(2, 1)]), _mode([(2, 1), (2, 1)]), "tokens_per_forward")
    with pytest.raises(ValueError, match="metric"):
        ratio_interval(_mode([(2, 1)]), _mode([(2, 1)]), "latency")


def test_speculation_timeline_orders_changes_per_workload_from_the_start():
    from tide.report import speculation_timeline, timeline_lines

    ev = [{"t_unix": 112.0, "workload": "code", "drafter_version": "1", "on": False,
           "reason": "acceptance_below_cost", "acceptance_by_depth": [0.1, 0.2]},
          {"t_unix": 100.5, "workload": "code", "drafter_version": "1", "on": True, "reason": "default",
           "acceptance_by_depth": []},
          {"t_unix": 101.0, "workload": "chat", "drafter_version": "1", "on": True, "reason": "default",
           "acceptance_by_depth": []}]
    tl = speculation_timeline(ev, t0_unix=100.0)
    assert [e["t_s"] for e in tl["code"]] == [0.5, 12.0] and [e["on"] for e in tl["code"]] == [True, False]
    assert tl["chat"][0]["reason"] == "default"
    assert timeline_lines(tl)[0] == "code: on at 0 s (default, drafter 1); off at 12 s (acceptance_below_cost, drafter 1)"


def test_served_comparison_decodes_through_engines_and_stays_lossless(tiny_target, tiny_drafter):
    from tide.engine.reference import ReferenceEngine
    from tide.report import compare_served

    common = dict(target_model_id="tiny", draft_len=3, max_batch_size=1, max_seq_len=200)
    engines = {"target": ReferenceEngine(tiny_target, None, None, "none", **common),
               "static": ReferenceEngine(tiny_target, None, tiny_drafter, "v1", **common, scheduler="fixed")}
    prompts = {"chat": [[5, 6, 7, 8], [9, 10, 11]], "code": [[12, 13, 14]]}
    try:
        res = compare_served(engines, prompts, 12, progress=lambda _: None)
    finally:
        for e in engines.values():
            e.close()
    for w, n in (("chat", 2), ("code", 1)):
        t, s = res[w]["target"], res[w]["static"]
        assert t.prompts == s.prompts == n and s.identical_to_target == n  # greedy: the target's tokens
        assert t.tokens == s.tokens == 11 * n  # 12 tokens each, the first (prefill) not timed
        assert t.forwards == t.committed == 11 * n  # one token per target-only forward
        assert 0 < s.forwards <= s.committed == 11 * n and all(x > 0 for x in s.prompt_decode_s)
