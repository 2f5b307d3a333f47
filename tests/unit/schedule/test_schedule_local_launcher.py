"""LocalLauncher against real processes (the retrain stub): outcomes, adoption, kill, identity."""
import os
import subprocess
import sys
import time

from tide.schedule.launcher import JobSpec
from tide.schedule.local_launcher import LocalLauncher, process_alive, process_start_ticks


def _spec(kit, job_id: str) -> JobSpec:
    jobs = kit.state_path.parent / "jobs"
    return JobSpec(job_id, jobs / f"{job_id}.result.json", jobs / f"{job_id}.log")


def _launcher(kit, config_path=None) -> LocalLauncher:
    return LocalLauncher(kit.command(), config_path, kit.state_path, kill_grace_s=0.5)


def _wait_outcome(launcher, handle, until):
    return until(lambda: launcher.poll(handle), timeout_s=15, what="job end")


def test_success_reads_the_result_and_passes_config(kit, until, tmp_path):
    cfg = tmp_path / "tide.yaml"
    cfg.write_text("{}\n")
    kit.set_control("ok", 0.2)
    launcher = _launcher(kit, str(cfg))
    handle = launcher.launch(_spec(kit, "j-ok"))
    assert launcher.poll(handle) is None  # still sleeping
    # its own process group, apart from ours: a signal to the scheduler's group misses it
    assert os.getpgid(handle["pid"]) == handle["pid"] != os.getpgid(0)
    outcome = _wait_outcome(launcher, handle, until)
    assert outcome.succeeded and outcome.exit_code == 0
    assert outcome.result["version"] == "7" and outcome.result["run_id"] == "run-abc"
    (rec,) = kit.launched()
    assert rec["job_id"] == "j-ok" and rec["config"] == str(cfg.resolve())


def test_failures_are_judged_from_exit_code_and_result(kit, until):
    launcher = _launcher(kit)
    kit.set_control("fail")
    out = _wait_outcome(launcher, launcher.launch(_spec(kit, "j-fail")), until)
    assert (out.status, out.exit_code) == ("failed", 3) and "'failed'" in out.reason
    kit.set_control("noresult")
    out = _wait_outcome(launcher, launcher.launch(_spec(kit, "j-nores")), until)
    assert (out.status, out.exit_code) == ("failed", 0) and "no result file" in out.reason
    kit.set_control("nothing")
    out = _wait_outcome(launcher, launcher.launch(_spec(kit, "j-nothing")), until)
    assert out.succeeded and out.result["status"] == "nothing_to_do"


def test_stale_result_of_an_earlier_attempt_is_not_trusted(kit, until):
    spec = _spec(kit, "j-same")
    spec.result_path.parent.mkdir(parents=True)
    spec.result_path.write_text('{"status": "registered", "version": "old"}')
    kit.set_control("noresult")
    launcher = _launcher(kit)
    out = _wait_outcome(launcher, launcher.launch(spec), until)
    assert out.status == "failed"


def test_a_new_launcher_adopts_a_running_job(kit, until):
    """What a restarted scheduler does: poll a job it did not start (exit code unknown)."""
    kit.set_control("ok", 1.0)
    first = _launcher(kit)
    handle = first.launch(_spec(kit, "j-adopt"))
    second = _launcher(kit)  # no Popen object for this pid
    assert second.poll(handle) is None
    assert second.find("j-adopt")["pid"] == handle["pid"]
    assert [jid for jid, _ in second.find_active()] == ["j-adopt"]
    other = LocalLauncher(kit.command(), None, kit.tmp / "other" / "state.json")
    assert other.find_active() == []  # jobs of another scheduler's state file are not ours
    first._children[handle["pid"]].wait()  # reap (the test process is the real parent)
    out = until(lambda: second.poll(handle), what="adopted job end")
    assert out.succeeded and out.exit_code is None and out.result["version"] == "7"


def test_kill_takes_the_whole_process_group(kit, until):
    kit.set_control("hang")  # ignores SIGTERM and has a grandchild
    launcher = _launcher(kit)
    handle = launcher.launch(_spec(kit, "j-hang"))
    rec = until(lambda: kit.launched(), what="stub start")[0]
    grandchild = rec["grandchild"]
    assert process_alive(grandchild)
    started = time.monotonic()
    launcher.kill(handle)
    assert time.monotonic() - started >= 0.5  # waited the grace period before SIGKILL
    assert not process_alive(handle["pid"])
    until(lambda: not process_alive(grandchild), what="grandchild gone")


def test_identity_survives_pid_checks():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ticks = process_start_ticks(proc.pid)
        assert process_alive(proc.pid, ticks)
        assert not process_alive(proc.pid, ticks + 1)  # same pid, different process: not ours
    finally:
        proc.kill()
        time.sleep(0.1)
    assert not process_alive(proc.pid)  # an unreaped zombie counts as gone
    proc.wait()
