"""Trigger policy: gates in order, exponential backoff, new-sample counting from the real index."""
import pytest

from tide.contracts import RESULT_DATA_WATERMARK
from tide.schedule.policy import (
    backoff_delay_s,
    count_new_samples,
    decide,
    newest_version,
    watermark_after_success,
    watermark_of,
)
from tide.schedule.state import FinishedJob, RunningJob, SchedulerState


def _success(finished_at_s: float, watermark_version: int | None = None) -> FinishedJob:
    return FinishedJob("j1", "local", finished_at_s - 10, finished_at_s, "succeeded", "exit 0",
                       watermark_version)


def test_backoff_doubles_from_base_and_is_capped():
    delays = [backoff_delay_s(n, 10.0, 100.0) for n in range(0, 7)]
    assert delays == [0.0, 10.0, 20.0, 40.0, 80.0, 100.0, 100.0]
    assert backoff_delay_s(10_000, 10.0, 100.0) == 100.0  # no overflow on a long streak


def test_launches_only_with_enough_samples(kit):
    cfg = kit.config(min_new_samples=100)
    assert decide(SchedulerState(), 99, 1000.0, cfg).reason == "not_enough"
    d = decide(SchedulerState(), 100, 1000.0, cfg)
    assert d.launch and d.reason == "launch"


def test_running_job_blocks_everything(kit):
    state = SchedulerState(running=RunningJob("j", "local", 0.0, 99.0, None, 5, {"pid": 1}))
    d = decide(state, 10**9, 1000.0, kit.config())
    assert not d.launch and d.reason == "running"


def test_cooldown_counts_from_last_success(kit):
    cfg = kit.config(cooldown_s=60.0)
    state = SchedulerState(last_success=_success(1000.0))
    d = decide(state, 10**6, 1030.0, cfg)
    assert (d.launch, d.reason, d.wait_s) == (False, "cooldown", 30.0)
    assert decide(state, 10**6, 1060.0, cfg).launch


def test_backoff_after_failures_then_retry(kit):
    cfg = kit.config(backoff_base_s=10.0, backoff_max_s=100.0)
    state = SchedulerState(consecutive_failures=3, last_failure_at_s=1000.0)
    d = decide(state, 10**6, 1039.0, cfg)  # third failure: 40 s
    assert (d.reason, round(d.wait_s, 6)) == ("backoff", 1.0)
    assert decide(state, 10**6, 1040.0, cfg).launch  # never blocked for good


def test_count_uses_the_commit_counts_after_the_watermark_version(kit):
    assert kit.add_file(tokens=40) == 1  # version 0 created the table
    kit.add_file(tokens=50)
    kit.add_file(tokens=70, model="org/other")
    assert count_new_samples(kit.table, None, "tokens") == 160
    assert count_new_samples(kit.table, 1, "tokens") == 120  # strictly after the watermark
    assert count_new_samples(kit.table, 1, "tokens", "org/m") == 50
    assert count_new_samples(kit.table, 3, "tokens") == 0
    assert count_new_samples(kit.table, None, "rows") == 12
    assert count_new_samples(kit.table, None, "requests") == 6
    assert count_new_samples(kit.table, None, "generated_tokens") == 80
    with pytest.raises(ValueError, match="sample_unit"):
        count_new_samples(kit.table, None, "bytes")


def test_watermark_advances_to_the_newest_version(kit):
    assert newest_version(kit.table, None) is None  # no table yet
    kit.add_file(tokens=10)
    kit.add_file(tokens=10)
    assert newest_version(kit.table, None) == 2
    assert newest_version(kit.table, 2) == 2
    assert watermark_of(SchedulerState()) is None
    assert watermark_of(SchedulerState(last_success=_success(5.0, watermark_version=2))) == 2


def test_watermark_after_success_is_what_the_job_read():
    assert watermark_after_success(10, 20, {RESULT_DATA_WATERMARK: 35}) == 35  # read after launch
    assert watermark_after_success(None, 20, {RESULT_DATA_WATERMARK: 35}) == 35
    assert watermark_after_success(40, 40, {RESULT_DATA_WATERMARK: 30}) == 40  # never backwards
    for silent in ({}, {RESULT_DATA_WATERMARK: None}, {RESULT_DATA_WATERMARK: "x"}, {RESULT_DATA_WATERMARK: 3.5},
                   {RESULT_DATA_WATERMARK: -1}, {RESULT_DATA_WATERMARK: True}):
        assert watermark_after_success(10, 20, silent) == 20  # no report: the newest version at launch


def test_bad_config_is_named(kit):
    from tide.schedule.policy import check_config

    check_config(kit.config())
    for field, value in (("sample_unit", "bytes"), ("interval_s", 0), ("min_new_samples", -1),
                         ("backoff_base_s", -1.0)):
        with pytest.raises(ValueError, match=f"schedule.{field}"):
            check_config(kit.config(**{field: value}))
