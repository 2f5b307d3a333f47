"""RetrainScheduler.tick with a real index, state file and local processes (clock injected)."""
import os

from tide.schedule.local_launcher import LocalLauncher, process_alive
from tide.schedule.scheduler import RetrainScheduler
from tide.schedule.state import RunningJob, StateStore


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _scheduler(kit, clock, **cfg):
    sc = kit.config(**cfg)
    launcher = LocalLauncher(sc.command, None, kit.state_path, kill_grace_s=sc.kill_grace_s)
    return RetrainScheduler(sc, kit.table, StateStore(kit.state_path), launcher, clock=clock)


def _run_to_end(sched, until):
    return until(lambda: sched.tick().reason != "running" and sched.store.load(),
                 timeout_s=15, what="job end")


def test_threshold_single_flight_and_watermark(kit, until):
    clock = Clock()
    sched = _scheduler(kit, clock, min_new_samples=100)
    gate = kit.set_control("ok", gate="gate")
    kit.add_file(tokens=60)
    assert sched.tick().reason == "not_enough"
    assert kit.launched() == [] and sched.store.load().running is None
    kit.add_file(tokens=60)
    d = sched.tick()
    assert d.launch and d.new_samples == 120
    assert sched.tick().reason == "running"  # a second trigger while it runs: no second job
    (gate / "read").touch()
    until(lambda: (gate / "was_read").exists(), what="the job's read")
    kit.add_file(tokens=500)  # arrives during the retrain, after its read
    (gate / "finish").touch()
    state = _run_to_end(sched, until)
    assert len(kit.launched()) == 1
    assert state.last_success.status == "succeeded" and state.last_success.version == "7"
    assert state.last_success.watermark_version == 2  # the version the job read
    ok, health = sched.health()
    assert ok and health["last_success_job"] == state.last_success.job_id
    assert sched.tick().new_samples == 500  # only what came after the launch counts


def test_failure_backs_off_then_next_retrain_succeeds(kit, until):
    clock = Clock()
    sched = _scheduler(kit, clock, backoff_base_s=10.0, backoff_max_s=15.0)
    kit.add_file(tokens=1000)
    kit.set_control("fail")
    assert sched.tick().launch
    state = _run_to_end(sched, until)
    assert state.consecutive_failures == 1 and state.history[-1].status == "failed"
    assert state.history[-1].exit_code == 3 and state.last_success is None
    d = sched.tick()
    assert (d.reason, d.wait_s) == ("backoff", 10.0)
    clock.t += 10.0
    assert sched.tick().launch  # a failure never blocks later retrains
    _run_to_end(sched, until)
    clock.t += 5.0
    assert sched.tick().wait_s == 10.0  # second failure: 20 s capped at 15, 5 of them passed
    clock.t += 10.0
    kit.set_control("ok")
    assert sched.tick().launch
    state = _run_to_end(sched, until)
    assert state.consecutive_failures == 0 and state.last_success is not None
    assert [h.status for h in state.history] == ["failed", "failed", "succeeded"]
    assert len(kit.launched()) == 3


def test_timeout_kills_the_job_and_its_children(kit, until):
    clock = Clock()
    sched = _scheduler(kit, clock, job_timeout_s=60.0)
    kit.add_file(tokens=1000)
    kit.set_control("hang")
    assert sched.tick().launch
    rec = until(lambda: kit.launched(), what="stub start")[0]
    clock.t += 59.0
    assert sched.tick().reason == "running"
    clock.t += 1.0
    sched.tick()
    state = sched.store.load()
    assert state.history[-1].status == "timed_out" and state.consecutive_failures == 1
    assert not process_alive(rec["pid"])
    until(lambda: not process_alive(rec["grandchild"]), what="grandchild gone")


def test_launch_error_is_recorded_as_failure(kit):
    clock = Clock()
    sched = _scheduler(kit, clock, command=("/nonexistent/tide-train",))
    kit.add_file(tokens=1000)
    assert sched.tick().launch
    state = sched.store.load()
    assert state.running is None and state.consecutive_failures == 1
    assert "launch failed" in state.history[-1].reason
    assert sched.tick().reason == "backoff"


def test_interrupted_launch_without_a_process_is_failed(kit):
    store = StateStore(kit.state_path)
    with store.transaction() as state:
        state.running = RunningJob("ghost", "local", 0.0, 1e12, None, 10, handle=None)
    sched = _scheduler(kit, Clock())
    assert sched.tick().reason == "backoff"
    last = store.load().history[-1]
    assert (last.job_id, last.status) == ("ghost", "failed") and "interrupted" in last.reason


def test_a_lost_state_file_does_not_cause_a_second_job(kit, until):
    clock = Clock()
    kit.add_file(tokens=1000)
    kit.set_control("ok", 1.5)
    first = _scheduler(kit, clock)
    assert first.tick().launch
    job_id = first.store.load().running.job_id
    os.unlink(kit.state_path)  # state lost while the job runs
    second = _scheduler(kit, clock)  # a new scheduler process
    assert second.tick().reason == "running"
    assert second.store.load().running.job_id == job_id
    first.launcher._children.popitem()[1].wait()  # reap in the real parent
    state = _run_to_end(second, until)
    assert len(kit.launched()) == 1 and state.last_success.job_id == job_id


def test_health_turns_unhealthy_on_tick_errors(kit):
    sched = _scheduler(kit, Clock())
    kit.state_path.parent.mkdir(parents=True, exist_ok=True)
    kit.state_path.write_text("garbage")
    sched.safe_tick()
    ok, details = sched.health()
    assert not ok and "StateError" in details["last_error"]
    kit.state_path.unlink()  # an operator moved it aside
    sched.safe_tick()
    assert sched.health()[0]


def test_switching_launcher_under_a_running_job_is_refused(kit):
    store = StateStore(kit.state_path)
    with store.transaction() as state:
        state.running = RunningJob("k", "kubernetes", 0.0, 1e12, None, 10,
                                   handle={"name": "tide-retrain-k", "namespace": "tide"})
    sched = _scheduler(kit, Clock())
    sched.safe_tick()
    ok, details = sched.health()
    assert not ok and "switch back" in details["last_error"]
    assert store.load().running.job_id == "k" and kit.launched() == []  # nothing lost or launched


def _launch_hanging(kit, until):
    """A scheduler whose retrain (a stub that ignores SIGTERM) is running; (scheduler, clock, job)."""
    clock = Clock()
    sched = _scheduler(kit, clock)
    kit.add_file(tokens=1000)
    kit.set_control("hang")
    assert sched.tick().launch
    return sched, clock, until(lambda: kit.launched(), what="stub start")[0]


def test_stop_leaves_a_retrain_running_unless_asked_to_cancel_it(kit, until):
    sched, _, first = _launch_hanging(kit, until)
    sched.stop()  # a long-lived scheduler's restart: the next one adopts the job
    assert process_alive(first["pid"]) and sched.store.load().running is not None

    sched.stop(cancel_running=True)  # the local stack's stop: kill it and say so
    state = sched.store.load()
    assert state.running is None and state.history[-1].status == "cancelled"
    assert state.consecutive_failures == 0 and state.last_failure_at_s is None
    assert not process_alive(first["pid"])
    until(lambda: not process_alive(first["grandchild"]), what="grandchild gone")
    kit.set_control("ok")
    assert sched.tick().launch  # no backoff after a cancel
    assert _run_to_end(sched, until).last_success is not None


def test_a_cancel_that_fails_leaves_the_retrain_recorded_for_the_next_scheduler(kit, until):
    sched, clock, first = _launch_hanging(kit, until)

    def refuse(handle):  # e.g. the Kubernetes API server is unreachable during shutdown
        raise ConnectionError("api server unreachable")

    real_kill, sched.launcher.kill = sched.launcher.kill, refuse
    sched.stop(cancel_running=True)  # returns: the service's finally must go on closing
    state = sched.store.load()
    assert state.running is not None and state.running.handle is not None
    assert state.history == [] or state.history[-1].status != "cancelled"
    assert process_alive(first["pid"])
    sched.launcher.kill = real_kill
    successor = _scheduler(kit, clock)
    successor.stop(cancel_running=True)
    assert successor.store.load().history[-1].status == "cancelled"
    assert not process_alive(first["pid"])


def test_watermark_follows_what_the_retrain_read(kit, until):
    """Commits between a retrain's launch and its read of the table are trained on: the
    next trigger counts only what the finished retrain did not read. A failed retrain leaves the
    watermark where it was."""
    clock = Clock()
    sched = _scheduler(kit, clock, min_new_samples=100)
    kit.add_file(tokens=120)
    gate = kit.set_control("ok", gate="first")
    assert sched.tick().launch
    kit.add_file(tokens=200)  # sealed after the launch, before the job reads
    (gate / "read").touch()
    until(lambda: (gate / "was_read").exists(), what="the job's read")
    kit.add_file(tokens=30)  # sealed after the read, while the job runs
    (gate / "finish").touch()
    state = _run_to_end(sched, until)
    assert state.last_success.watermark_version == 2
    assert sched.tick().new_samples == 30  # the 200 tokens it read are not new again

    kit.add_file(tokens=400)
    gate = kit.set_control("fail", gate="second")
    assert sched.tick().launch
    (gate / "read").touch()
    (gate / "finish").touch()
    state = _run_to_end(sched, until)
    assert state.history[-1].status == "failed" and state.last_success.watermark_version == 2
    assert sched.tick().new_samples == 430  # all it read is still new


def test_a_retrain_with_nothing_to_do_is_counted_apart_from_those_that_judged_a_candidate(kit, until):
    """A retrain that found too little readable data succeeded but registered nothing: a watcher of the
    loop (the demo's) must tell it from one whose candidate was judged and not promoted."""
    from tide import metrics

    def counts():
        return (metrics.SCHED_RETRAINS_FINISHED.labels("succeeded")._value.get(),
                metrics.SCHED_RETRAINS_NOTHING_TO_DO._value.get())

    sched = _scheduler(kit, Clock(), min_new_samples=100)
    kit.set_control("nothing")
    kit.add_file(tokens=120)
    before = counts()
    assert sched.tick().launch
    state = _run_to_end(sched, until)
    assert state.last_success.version is None
    assert [a - b for a, b in zip(counts(), before)] == [1, 1]
    kit.set_control("ok")
    kit.add_file(tokens=120)
    before = counts()
    assert sched.tick().launch
    assert _run_to_end(sched, until).last_success.version == "7"
    assert [a - b for a, b in zip(counts(), before)] == [1, 0]
