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
