"""Workload shifts the scheduler sees: the captured workload mix in real data files, the engines'
live acceptance over real /metrics pages, and what a detected shift changes in the next launch."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

from tide.config import replace
from tide.dataset.schema import Row, partition_values
from tide.dataset.writer import DataFileWriter
from tide.process import free_port
from tide.records import Record
from tide.schedule.local_launcher import LocalLauncher
from tide.schedule.scheduler import RetrainScheduler
from tide.schedule.shift import ACCEPT, MIX, AcceptanceWatch, ShiftWatch, WorkloadMix, distance
from tide.schedule.state import StateStore
from tide.traffic import scrape

H = 8
T0 = 1_700_000_000.0


def write_requests(table, workloads: list[str | None], t0: float, tokens: int = 50, seed: int = 0) -> float:
    """One ingest commit of one request per entry of ``workloads`` (tag), a second apart from ``t0``."""
    rng = np.random.default_rng(seed)
    table.ensure()
    writer = DataFileWriter(table.location, partition_values(t0), 4, 1 << 30)
    for i, workload in enumerate(workloads):
        at = t0 + i
        rec = Record(request_id=f"r{seed}-{i}", target_model_id="org/m", drafter_version="1", aux_layer_ids=(1, 2, 3),
                     workload=workload, started_at_s=at - 1, finished_at_s=at, hidden_size=H,
                     hidden_dtype="bfloat16", token_ids=rng.integers(0, 1000, tokens).astype(np.int32),
                     loss_mask=(np.arange(tokens) >= 4).astype(np.uint8),
                     aux_hidden=rng.bytes(tokens * 3 * H * 2), final_hidden=rng.bytes(tokens * H * 2))
        writer.add(Row(rec, "t", 0, seed * 1000 + i, 0, at))
    out = writer.finish()
    table.append([out.add], out.counts)
    return t0 + len(workloads)


def test_the_mix_signal_names_the_new_workload_once(kit):
    mix = WorkloadMix(kit.table, recent_tokens=500, reference_tokens=2000, min_distance=0.5)
    t = write_requests(kit.table, ["chat"] * 40, T0, seed=1)  # 2000 tokens of chat
    assert mix.check(None) is None and mix.shares == {"chat": 1.0}
    first_code = t
    t = write_requests(kit.table, ["code"] * 4, t, seed=2)  # 200 code tokens: 40% of the newest 500
    assert mix.check(None) is None
    t = write_requests(kit.table, ["code"] * 8, t, seed=3)
    found = mix.check(None)
    assert found is not None and found.signal == MIX and found.workloads == ("code",)
    assert re.match(r"code [0-5]% -> 100% of the newest 500 ", found.detail), found.detail
    assert found.since_s == first_code  # where the code traffic began, not where the newest 500 tokens do
    # after it, the signal reads only what came since: more code is the same shift, not a new one
    write_requests(kit.table, ["code"] * 30, t, seed=4)
    assert mix.check(found.since_s) is None


def test_a_commit_holding_more_new_rows_than_both_mixes_is_still_a_shift(kit):
    """Ingest may commit a minute of new traffic at once: compared with what the last look saw."""
    mix = WorkloadMix(kit.table, recent_tokens=500, reference_tokens=1000, min_distance=0.5)
    t = write_requests(kit.table, ["chat"] * 30, T0, seed=1)
    assert mix.check(None) is None
    first_code = t
    write_requests(kit.table, ["code"] * 60, t, seed=2)  # 3000 tokens in one commit: all of both mixes
    found = mix.check(None)
    assert found is not None and found.workloads == ("code",) and found.since_s == first_code, found


def test_a_first_look_with_too_little_to_compare_still_counts_as_before(kit):
    """The first look saw the recent tokens but fewer than a reference's worth before them (a short
    warm-up of chat); the next commit brings more new rows than both mixes at once: the rows of that
    first look are what came before."""
    mix = WorkloadMix(kit.table, recent_tokens=500, reference_tokens=1000, min_distance=0.5)
    t = write_requests(kit.table, ["chat"] * 18, T0, seed=1)  # 900 tokens: 500 recent, 400 before
    assert mix.check(None) is None
    first_code = t
    write_requests(kit.table, ["code"] * 60, t, seed=2)
    found = mix.check(None)
    assert found is not None and found.workloads == ("code",) and found.since_s == first_code, found


def test_a_first_commit_holding_the_warm_up_and_more_new_rows_than_both_mixes_is_a_shift(kit):
    """A fast stack's first commit: the whole chat warm-up and more code than both mixes, one look."""
    mix = WorkloadMix(kit.table, recent_tokens=500, reference_tokens=1000, min_distance=0.5)
    t = write_requests(kit.table, ["chat"] * 24 + ["code"] * 30, T0, seed=1)
    found = mix.check(None)
    assert found is not None and found.workloads == ("code",) and found.since_s == t - 30, found


def write_partitions(table, workloads: list[str], t0: float, partitions: int = 4) -> float:
    """Ingest of a topic with ``partitions`` partitions: requests spread round-robin, one commit per
    partition, so the files of one roll overlap in capture time."""
    writers = [DataFileWriter(table.location, partition_values(t0), 4, 1 << 30) for _ in range(partitions)]
    rng = np.random.default_rng(7)
    table.ensure()
    for i, workload in enumerate(workloads):
        at, tokens = t0 + i, 50
        rec = Record(request_id=f"p{i}", target_model_id="org/m", drafter_version="1", aux_layer_ids=(1, 2, 3),
                     workload=workload, started_at_s=at - 1, finished_at_s=at, hidden_size=H,
                     hidden_dtype="bfloat16", token_ids=rng.integers(0, 1000, tokens).astype(np.int32),
                     loss_mask=np.ones(tokens, np.uint8), aux_hidden=rng.bytes(tokens * 3 * H * 2),
                     final_hidden=rng.bytes(tokens * H * 2))
        writers[i % partitions].add(Row(rec, "t", i % partitions, i, 0, at))
    for writer in writers:
        out = writer.finish()
        table.append([out.add], out.counts)
    return t0 + len(workloads)


@pytest.mark.parametrize("code_requests", [20, 60, 200])
def test_a_first_look_at_partition_commits_holding_warm_up_and_new_traffic_is_a_shift(kit, code_requests):
    """The quick demo's case: a short chat warm-up (fewer tokens than a reference) and then code, the
    first look finding both in four partitions' overlapping files (the newest of which hold little chat)."""
    mix = WorkloadMix(kit.table, recent_tokens=500, reference_tokens=1000, min_distance=0.5)
    t = write_partitions(kit.table, ["chat"] * 12 + ["code"] * code_requests, T0)
    found = mix.check(None)
    assert found is not None and found.workloads == ("code",) and found.since_s == t - code_requests, found
    assert mix.check(found.since_s) is None  # one shift, detected once


def test_a_later_look_reads_the_rows_before_its_last_one_across_overlapping_files(kit):
    """The first look saw the chat warm-up; the next rolls bring far more code than both mixes, in
    per-partition files whose time ranges overlap the warm-up's."""
    mix = WorkloadMix(kit.table, recent_tokens=500, reference_tokens=1000, min_distance=0.5)
    t = write_partitions(kit.table, ["chat"] * 16, T0)
    assert mix.check(None) is None
    t = write_partitions(kit.table, ["code"] * 100, t)
    found = mix.check(None)
    assert found is not None and found.workloads == ("code",) and found.since_s == t - 100, found


def test_a_steady_mixture_is_no_shift(kit):
    mix = WorkloadMix(kit.table, recent_tokens=500, reference_tokens=2000, min_distance=0.5)
    t = T0
    for k in range(6):  # chat and code interleaved, and requests with no tag
        t = write_requests(kit.table, ["chat", "code", None, "code"] * 5, t, seed=10 + k)
        assert mix.check(None) is None
    assert set(mix.shares) == {"chat", "code", "untagged"}
    assert abs(mix.shares["code"] - 0.5) < 0.1


def test_mix_distance_is_total_variation():
    assert distance({"a": 1.0}, {"a": 1.0}) == 0.0
    assert distance({"a": 1.0}, {"b": 1.0}) == 1.0
    assert distance({"a": 0.5, "b": 0.5}, {"a": 1.0}) == pytest.approx(0.5)


class Engine:
    """An engine's acceptance metrics on a real /metrics endpoint (the names the engine exports)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.accept = Histogram("tide_engine_accept_length_tokens", "x", ["drafter_version"],
                                buckets=(1, 2, 3, 4, 5), registry=self.registry)
        self.info = Gauge("tide_engine_drafter_info", "x", ["drafter_version"], registry=self.registry)
        self.port = free_port()
        self.server, _ = start_http_server(self.port, addr="127.0.0.1", registry=self.registry)
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def serve(self, version: str, accept_lengths: list[float]) -> None:
        self.info.clear()
        self.info.labels(version).set(1)
        for x in accept_lengths:
            self.accept.labels(version).observe(x)


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.server.shutdown()


def test_the_acceptance_signal_sees_a_drop_not_noise_or_a_swap(engine):
    watch = AcceptanceWatch((engine.url,), window_s=60.0, drop=0.15, min_forwards=100)
    now = 1000.0
    for _ in range(6):  # chat: 1.8 tokens per forward, with noise
        engine.serve("1", [1.0, 2.0, 3.0, 1.0, 2.0] * 30)
        watch.observe(now)
        assert watch.check(now, None) is None
        now += 30.0
    engine.serve("2", [3.0] * 150)  # a swap to a better drafter: a new reading, not compared with v1's
    watch.observe(now)
    now += 30.0
    for _ in range(3):
        engine.serve("2", [3.0] * 150)
        watch.observe(now)
        assert watch.check(now, None) is None
        now += 30.0
    for _ in range(2):  # the traffic changes: v2 now commits 2.0 per forward (-33%)
        engine.serve("2", [2.0] * 150)
        watch.observe(now)
        now += 30.0
    found = watch.check(now - 30.0, None)
    assert found is not None and found.signal == ACCEPT and "drafter 2: 3.00 -> 2.00" in found.detail, found
    assert watch.check(now - 30.0, now - 30.0) is None  # after a detection only newer readings count


def test_an_unreachable_engine_reads_nothing():
    watch = AcceptanceWatch((f"http://127.0.0.1:{free_port()}/metrics",), 60.0, 0.15, 100, read=scrape)
    watch.observe(1.0)
    assert watch.readings == [] and watch.check(100.0, None) is None


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_a_detected_shift_launches_sooner_shorter_and_is_recorded(kit, until):
    from tide import metrics

    clock = Clock()
    sc = kit.config(min_new_samples=100_000, cooldown_s=10_000.0, shift_min_new_samples=1000,
                    shift_recent_tokens=500, shift_reference_tokens=2000,
                    shift_train={"max_train_s": "45", "update_fraction": "1.0"})
    launcher = LocalLauncher(sc.command, None, kit.state_path, kill_grace_s=sc.kill_grace_s)
    sched = RetrainScheduler(sc, kit.table, StateStore(kit.state_path), launcher, clock=clock)
    t = write_requests(kit.table, ["chat"] * 40, T0, seed=1)
    assert sched.tick().reason == "not_enough" and sched.store.load().shift is None
    first_code = t
    write_requests(kit.table, ["code"] * 12, t, seed=2)
    gate = kit.set_control("ok", gate="gate")
    d = sched.tick()  # 2600 new tokens: far below 100k, but a shift asks only 1000
    assert d.launch and d.shift and d.threshold == 1000
    shift = sched.store.load().shift
    assert (shift.signal, shift.workloads, shift.job_id) == (MIX, ["code"], sched.store.load().running.job_id)
    (job,) = until(kit.launched, what="the launch")
    env = _environ(job["pid"])  # the shift's retrain: a shorter run, on what came since the shift
    assert env["TIDE_TRAIN__MAX_TRAIN_S"] == "45" and env["TIDE_TRAIN__UPDATE_FRACTION"] == "1.0"
    assert float(env["TIDE_TRAIN__WINDOW_SINCE_S"]) == first_code
    assert env["TIDE_TRAIN__PATCH"] == "true"  # registered as a patch: the next full retrain starts past it
    ok, health = sched.health()
    assert health["shift"]["retrain_state"] == "running" and health["shift"]["signal"] == MIX
    (gate / "read").touch()
    (gate / "finish").touch()
    until(lambda: sched.tick().reason != "running", timeout_s=15, what="the job's end")
    state = sched.store.load()
    assert (state.shift.status, state.shift.version) == ("succeeded", "7")
    assert metrics.SCHED_SHIFT_INFO.labels(MIX, "code", shift.job_id, "succeeded")._value.get() == 1
    # the next retrain is an ordinary one: the full threshold and the cool-down again
    clock.t += 1.0
    d = sched.tick()
    assert not d.launch and d.reason == "cooldown" and d.threshold == 100_000 and not d.shift


def test_a_shift_counts_only_what_was_committed_since_its_new_traffic_began(kit, until):
    """The traffic before the shift (here 2000 tokens since the last retrain) does not count toward
    the shift's threshold: its retrain launches when its own window holds it."""
    now_s = time.time()
    clock = Clock(now_s)
    sc = kit.config(min_new_samples=100_000, cooldown_s=10_000.0, shift_min_new_samples=1000,
                    shift_recent_tokens=500, shift_reference_tokens=2000)
    launcher = LocalLauncher(sc.command, None, kit.state_path, kill_grace_s=sc.kill_grace_s)
    sched = RetrainScheduler(sc, kit.table, StateStore(kit.state_path), launcher, clock=clock)
    write_requests(kit.table, ["chat"] * 40, now_s - 100.0, seed=1)  # captured earlier, committed now
    sched.tick()
    time.sleep(0.05)  # the log keeps commit times in milliseconds
    t = write_requests(kit.table, ["code"] * 12, time.time(), seed=2)  # 600 tokens of the new traffic
    d = sched.tick()
    assert sched.store.load().shift is not None and sched.store.load().shift.pending
    assert (d.launch, d.reason, d.shift, d.new_samples) == (False, "not_enough", True, 600)
    write_requests(kit.table, ["code"] * 10, t, seed=3)
    gate = kit.set_control("ok", gate="gate")
    clock.t += 1.0
    d = sched.tick()
    assert d.launch and d.shift and d.new_samples == 1100
    until(kit.launched, what="the launch")
    (gate / "read").touch()
    (gate / "finish").touch()


def test_a_shift_retrain_with_too_little_new_traffic_leaves_the_shift_pending(kit, until):
    """When its window (since the shift) held too few requests to train ("nothing to do": fewer than
    the retrain's own minimum) the shift is not spent: the next launch is its again, at the shift's
    threshold, with its settings."""
    clock = Clock()
    sc = kit.config(min_new_samples=100_000, cooldown_s=10_000.0, shift_min_new_samples=1000,
                    shift_recent_tokens=500, shift_reference_tokens=2000)
    launcher = LocalLauncher(sc.command, None, kit.state_path, kill_grace_s=sc.kill_grace_s)
    sched = RetrainScheduler(sc, kit.table, StateStore(kit.state_path), launcher, clock=clock)
    t = write_requests(kit.table, ["chat"] * 40, T0, seed=1)
    sched.tick()
    t = write_requests(kit.table, ["code"] * 12, t, seed=2)
    kit.set_control("nothing")
    assert sched.tick().launch
    first_job = sched.store.load().shift.job_id
    until(lambda: sched.tick().reason != "running", timeout_s=15, what="the job's end")
    shift = sched.store.load().shift
    assert shift.pending and shift.status is None and len(sched.store.load().shifts) == 1
    clock.t += 1.0
    assert not sched.tick().launch  # nothing new since: it waits for the shift's threshold again
    write_requests(kit.table, ["code"] * 30, t, seed=3)
    gate = kit.set_control("ok", gate="gate")  # the relaunch waits for the test to read its settings
    clock.t += 1.0
    d = sched.tick()
    assert d.launch and d.shift and d.threshold == 1000  # no cool-down: still the shift's retrain
    shift = sched.store.load().shift
    assert shift.job_id not in (None, first_job) and until(lambda: len(kit.launched()) == 2, what="the relaunch")
    assert _environ(kit.launched()[-1]["pid"])["TIDE_TRAIN__PATCH"] == "true"
    (gate / "read").touch()
    (gate / "finish").touch()


def test_no_detection_without_the_setting(kit):
    sc = kit.config(shift_detection=False, min_new_samples=100_000, shift_recent_tokens=500)
    launcher = LocalLauncher(sc.command, None, kit.state_path)
    sched = RetrainScheduler(sc, kit.table, StateStore(kit.state_path), launcher, clock=Clock())
    t = write_requests(kit.table, ["chat"] * 40, T0, seed=1)
    write_requests(kit.table, ["code"] * 20, t, seed=2)
    assert sched.tick().reason == "not_enough" and sched.store.load().shifts == []


def test_a_shift_train_key_that_is_no_train_setting_fails_at_start(kit):
    sc = kit.config(shift_train={"max_trian_s": "45"})
    with pytest.raises(ValueError, match=r"shift_train: \['max_trian_s'\]"):
        RetrainScheduler(sc, kit.table, StateStore(kit.state_path), LocalLauncher(sc.command, None, kit.state_path))


def test_both_signals_in_one_watch(kit, engine):
    sc = replace(kit.config(), shift_recent_tokens=500, shift_reference_tokens=2000,
                 shift_metrics_urls=(engine.url,), shift_accept_window_s=60.0, shift_accept_min_forwards=100)
    watch = ShiftWatch(sc, kit.table)
    assert watch.accept is not None and watch.check(time.time(), None) is None


def test_a_local_retrain_runs_on_its_own_core_and_yields(tmp_path):
    """``schedule.local_cpus`` "last" and ``local_nice``: the launched job and its threads."""
    import sys

    from tide.schedule.launcher import JobSpec
    from tide.schedule.local_launcher import parse_cpus

    allowed = os.sched_getaffinity(0)
    launcher = LocalLauncher([sys.executable, "-c", "import sys, time; time.sleep(30)"], None,
                             tmp_path / "state.json", kill_grace_s=1.0, cpus="last", nice=7)
    handle = launcher.launch(JobSpec("j1", tmp_path / "r.json", tmp_path / "j1.log"))
    try:
        expected = {max(allowed)} if len(allowed) >= 2 else allowed
        assert os.sched_getaffinity(handle["pid"]) == expected
        assert os.getpriority(os.PRIO_PROCESS, handle["pid"]) == max(7, os.getpriority(os.PRIO_PROCESS, 0))
    finally:
        launcher.kill(handle)
    assert parse_cpus("", allowed) == set() and parse_cpus(str(min(allowed)), allowed) == {min(allowed)}
    with pytest.raises(ValueError, match="local_cpus"):
        parse_cpus("9999", allowed)
    with pytest.raises(ValueError, match="local_cpus"):
        parse_cpus("two", allowed)
