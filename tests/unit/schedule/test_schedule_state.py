"""State file: round trip, atomic saves, corrupt files refused, exclusive lock across processes."""
import json
import subprocess
import sys
import textwrap
import time

import pytest

from tide.schedule.state import FinishedJob, RunningJob, SchedulerState, StateError, StateStore, jobs_report


def test_round_trip_keeps_everything(tmp_path):
    store = StateStore(tmp_path / "s" / "state.json")
    assert store.load() == SchedulerState()  # no file yet: a fresh state
    with store.transaction() as state:
        state.running = RunningJob("j2", "local", 10.0, 40.0, 5, 123, {"pid": 42, "pgid": 42})
        state.last_success = FinishedJob("j1", "local", 1.0, 2.0, "succeeded", "exit 0", 5, 99,
                                         0, "7", "run-1")
        state.history = [state.last_success]
        state.consecutive_failures, state.last_failure_at_s, state.launched_total = 2, 3.0, 2
    loaded = store.load()
    assert loaded.running.handle == {"pid": 42, "pgid": 42}
    assert loaded.last_success.version == "7" and loaded.last_success.watermark_version == 5
    assert (loaded.consecutive_failures, loaded.last_failure_at_s, loaded.launched_total) == (2, 3.0, 2)
    assert loaded.history == [loaded.last_success]
    assert list(store.path.parent.glob(".*.tmp")) == []  # no temporary left behind


def test_a_version_1_file_loads_with_no_watermark(tmp_path):
    # its watermarks were dataset-index times: meaningless to the table's log, so everything counts once
    job = {"job_id": "j1", "launcher": "local", "started_at_s": 1.0, "finished_at_s": 2.0, "status": "succeeded",
           "reason": "exit 0", "watermark_s": 123.5, "new_samples": 9}
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "last_success": job, "history": [job]}))
    loaded = StateStore(tmp_path / "state.json").load()
    assert loaded.last_success.watermark_version is None and loaded.history[0].job_id == "j1"


def test_saves_even_when_the_body_raises(tmp_path):
    store = StateStore(tmp_path / "state.json")
    with pytest.raises(RuntimeError):
        with store.transaction() as state:
            state.launched_total = 1  # e.g. a job was launched, then something failed
            raise RuntimeError("after launch")
    assert store.load().launched_total == 1


def test_corrupt_file_is_refused_and_left_untouched(tmp_path):
    store = StateStore(tmp_path / "state.json")
    store.path.write_text("{not json")
    with pytest.raises(StateError, match="state.json"):
        store.load()
    with pytest.raises(StateError):
        with store.transaction():
            pass
    assert store.path.read_text() == "{not json"  # nothing lost: an operator can inspect it
    store.path.write_text(json.dumps({"version": 99}))
    with pytest.raises(StateError, match="version"):
        store.load()


def test_transaction_excludes_another_process(tmp_path):
    """A second process's transaction waits until the first releases the lock."""
    path = tmp_path / "state.json"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from tide.schedule.state import StateStore
        with StateStore({str(path)!r}).transaction() as s:
            s.launched_total = 5
            print("locked", flush=True)
            time.sleep(1.0)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        with StateStore(path).transaction() as state:
            waited = time.monotonic() - started
            seen = state.launched_total
            state.launched_total += 1
        assert waited > 0.5, waited  # blocked while the other process held it
        assert seen == 5  # and then saw what it wrote
        assert StateStore(path).load().launched_total == 6
    finally:
        holder.kill()
        holder.wait()


def test_the_jobs_report_gives_each_retrain_its_held_out_acceptance_by_workload(tmp_path):
    store = StateStore(tmp_path / "state.json")
    with store.transaction() as state:
        state.history = [FinishedJob("j1", "local", 100.0, 160.0, "succeeded", "exit 0", 5, 99, 0, "3", "run-1")]
    metrics = {"champion_sim_accept_length": 2.0, "candidate_sim_accept_length": 2.4,
               "champion_sim_accept_length.chat": 2.3, "candidate_sim_accept_length.chat": 2.2,
               "heldout_positions.chat": 140, "champion_sim_accept_length.ko:support": 1.5,
               "candidate_sim_accept_length.ko:support": 2.5, "heldout_positions.ko:support": 2210,
               "recent_requests": 157, "replay_requests": 57, "rehearsal_requests": 100}
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "j1.result.json").write_text(json.dumps({"status": "registered", "metrics": metrics}))
    [job] = jobs_report(store.path, shift_at_s=40.0)
    assert job["sim_accept"] == [2.0, 2.4] and job["launched_after_shift_s"] == 60.0
    assert job["sim_accept_by_workload"] == {"chat": [2.3, 2.2, 140], "ko:support": [1.5, 2.5, 2210]}
    assert (job["recent_requests"], job["replay_requests"], job["rehearsal_requests"]) == (157, 57, 100)
