"""Sampling: deterministic per request, fractions respected, per-workload overrides."""
import pytest

from tide.capture.sampling import SamplingPolicy, unit_hash


def test_decision_is_deterministic_and_near_the_fraction():
    policy = SamplingPolicy(fraction=0.3)
    ids = [f"req-{i}" for i in range(20_000)]
    first = [policy.admits(r, None) for r in ids]
    assert first == [policy.admits(r, None) for r in ids]
    assert abs(sum(first) / len(ids) - 0.3) < 0.015


def test_workload_fractions_override_the_default():
    policy = SamplingPolicy(fraction=1.0, workload_fractions={"code": 0.0, "chat": 0.5})
    ids = [f"r{i}" for i in range(4000)]
    assert all(policy.admits(r, None) for r in ids)
    assert all(policy.admits(r, "korean") for r in ids)  # not named: default
    assert not any(policy.admits(r, "code") for r in ids)
    assert 0.45 < sum(policy.admits(r, "chat") for r in ids) / len(ids) < 0.55


def test_bad_fraction_is_rejected():
    with pytest.raises(ValueError, match="code"):
        SamplingPolicy(workload_fractions={"code": 1.5})


def test_unit_hash_range():
    values = [unit_hash(str(i)) for i in range(1000)]
    assert all(0.0 <= v < 1.0 for v in values)
