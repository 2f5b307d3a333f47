"""The real scheduler service (tide/services/scheduler.py) over a real dataset table.

Data files are written and committed with the dataset's own writer and table, exactly as ingest
commits them. The launched command is tests/stubs/retrain_stub.py, a real process with the
retrain job's command-line and result-file contract (sleeps, fails, or hangs on demand); every
start appends a line to a launches file, so "exactly one job" is counted from the processes
themselves, not from the scheduler's bookkeeping. The scheduler is killed (SIGKILL) and stopped
(SIGTERM) mid-retrain and started again.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from stubs import retrain_stub
from stubs.retrain_stub import kill_stubs

from tide.dataset.schema import Row, partition_values
from tide.dataset.table import DatasetTable
from tide.dataset.writer import DataFileWriter
from tide.process import free_port, python_service
from tide.records import Record
from tide.schedule.local_launcher import process_alive
from tide.schedule.state import StateStore

STUB = Path(retrain_stub.__file__)  # run as a script: the scheduler launches a command line
H = 8


class Stack:
    """Dataset + config + scheduler processes for one test; everything stopped at teardown."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.data_dir = tmp / "dataset"
        self.table = DatasetTable(self.data_dir)
        self.launches = tmp / "launches.jsonl"
        self.control = tmp / "control.json"
        self.state_path = tmp / "sched" / "state.json"
        self.port = free_port()
        self.services = []
        self._offset = 0

    def write_config(self, **schedule) -> Path:
        sched = {"interval_s": 0.3, "min_new_samples": 100, "sample_unit": "tokens",
                 "cooldown_s": 0, "job_timeout_s": 60, "kill_grace_s": 0.5,
                 "backoff_base_s": 1.5, "backoff_max_s": 10, "metrics_port": self.port,
                 "state_path": str(self.state_path),
                 "command": [sys.executable, str(STUB), "--launches", str(self.launches),
                             "--control", str(self.control)]}
        sched.update(schedule)
        path = self.tmp / "tide.yaml"
        path.write_text(yaml.safe_dump({"home": str(self.tmp / "home"),
                                        "ingest": {"data_dir": str(self.data_dir)},
                                        "schedule": sched}))
        return path

    def ingest(self, requests: int, tokens: int) -> None:
        """Commit one data file of ``requests`` records x ``tokens`` positions, as ingest does."""
        rng = np.random.default_rng(self._offset)
        now = time.time()
        f = DataFileWriter(self.table.location, partition_values(now), 4, 1 << 30)
        for i in range(requests):
            rec = Record(request_id=f"r{self._offset}", target_model_id="org/m",
                         drafter_version="v1", aux_layer_ids=(1, 2, 3), workload=None,
                         started_at_s=now - 1, finished_at_s=now, hidden_size=H,
                         hidden_dtype="bfloat16",
                         token_ids=rng.integers(0, 1000, tokens).astype(np.int32),
                         loss_mask=(np.arange(tokens) >= 2).astype(np.uint8),
                         aux_hidden=rng.bytes(tokens * 3 * H * 2),
                         final_hidden=rng.bytes(tokens * H * 2))
            f.add(Row(rec, "tide.hidden-states", 0, self._offset, 0, now))
            self._offset += 1
        self.table.ensure()
        out = f.finish()
        self.table.append([out.add], out.counts)

    def set_control(self, mode: str, sleep_s: float = 0.0) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({"mode": mode, "sleep_s": sleep_s}))
        tmp.replace(self.control)

    def start(self, config: Path):
        svc = python_service(f"scheduler-{len(self.services)}", "tide.services.scheduler",
                             ["--config", str(config)], self.tmp / "logs",
                             health_url=f"http://127.0.0.1:{self.port}/health")
        self.services.append(svc.start())
        svc.wait_healthy(timeout_s=60)
        return svc

    def launched(self) -> list[dict]:
        if not self.launches.exists():
            return []
        return [json.loads(line) for line in self.launches.read_text().splitlines()]

    def health(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).json()

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v
                                               for k, v in labels.items()):
                    return sample.value
        return 0.0

    def state(self):
        return StateStore(self.state_path).load()

    def wait_ticks(self, n: int, decision: str, wait) -> None:
        """Let ``n`` more ticks with this decision happen (proves the scheduler kept deciding)."""
        seen = self.metric("tide_scheduler_ticks_total", decision=decision)
        wait(lambda: self.metric("tide_scheduler_ticks_total", decision=decision) >= seen + n,
             15, 0.1, f"{n} '{decision}' ticks")

    def close(self) -> None:
        for svc in self.services:
            if svc.proc is not None and svc.proc.poll() is None:
                svc.proc.kill()
                svc.proc.wait(timeout=10)
        kill_stubs(self.launched(), self.state_path)


@pytest.fixture
def stack(tmp_path):
    s = Stack(tmp_path)
    yield s
    s.close()


def test_threshold_single_flight_and_sigkill_restart(stack, wait):
    config = stack.write_config()
    stack.ingest(requests=3, tokens=20)  # 60 tokens < 100
    stack.set_control("ok", sleep_s=5.0)
    first = stack.start(config)
    stack.wait_ticks(3, "not_enough", wait)
    assert stack.launched() == []
    assert stack.health()["new_samples"] == 60
    assert stack.metric("tide_scheduler_new_samples") == 60

    stack.ingest(requests=3, tokens=20)  # 120 >= 100: exactly one retrain
    (job,) = wait(stack.launched, 15, 0.1, "a launch")
    assert job["config"] == str(config)  # the scheduler passes its config on
    stack.wait_ticks(3, "running", wait)  # triggers during the retrain: no second job
    assert len(stack.launched()) == 1
    assert stack.metric("tide_scheduler_retrain_running") == 1

    first.proc.kill()  # the scheduler dies mid-retrain; the retrain must not
    first.proc.wait(timeout=10)
    assert process_alive(job["pid"])
    stack.start(config)
    stack.wait_ticks(3, "running", wait)  # re-adopted, not relaunched
    assert stack.health()["running"] == job["job_id"]
    assert len(stack.launched()) == 1

    wait(lambda: stack.state().last_success is not None, 20, 0.2, "the retrain's success")
    state = stack.state()
    assert len(stack.launched()) == 1
    assert state.last_success.job_id == job["job_id"] and state.last_success.version == "7"
    assert state.last_success.exit_code is None  # adopted: only the result file speaks
    assert stack.metric("tide_scheduler_retrains_finished_total", outcome="succeeded") == 1
    assert stack.metric("tide_scheduler_last_success_timestamp_seconds") > 0
    stack.wait_ticks(3, "not_enough", wait)  # the used data no longer counts
    assert stack.health()["new_samples"] == 0 and len(stack.launched()) == 1


def test_sigterm_leaves_the_retrain_running_and_restart_adopts_it(stack, wait):
    config = stack.write_config()
    stack.ingest(requests=5, tokens=30)
    stack.set_control("ok", sleep_s=4.0)
    first = stack.start(config)
    (job,) = wait(stack.launched, 15, 0.1, "a launch")
    started = time.monotonic()
    assert first.stop(stop_timeout_s=10) == 0  # SIGTERM: clean exit, promptly
    assert time.monotonic() - started < 5
    assert process_alive(job["pid"])  # not killed, not waited for
    stack.start(config)
    wait(lambda: stack.state().last_success is not None, 20, 0.2, "the retrain's success")
    assert len(stack.launched()) == 1
    assert stack.state().last_success.job_id == job["job_id"]


def test_failure_is_recorded_backs_off_and_the_next_retrain_runs(stack, wait):
    config = stack.write_config(backoff_base_s=1.5)
    stack.ingest(requests=5, tokens=30)
    stack.set_control("fail")
    stack.start(config)
    wait(lambda: stack.state().consecutive_failures == 1, 15, 0.1, "a recorded failure")
    stack.set_control("ok")
    wait(lambda: stack.state().last_success is not None, 15, 0.1, "the retry's success")
    first, second = stack.launched()
    state = stack.state()
    assert [h.status for h in state.history] == ["failed", "succeeded"]
    assert state.history[0].exit_code == 3 and state.consecutive_failures == 0
    assert second["t"] - first["t"] >= 1.5  # the backoff was honoured
    assert stack.metric("tide_scheduler_retrains_finished_total", outcome="failed") == 1
    assert stack.metric("tide_scheduler_retrains_launched_total", launcher="local") == 2


def test_timed_out_retrain_is_killed_with_its_children(stack, wait):
    config = stack.write_config(job_timeout_s=1.5, backoff_base_s=0.5)
    stack.ingest(requests=5, tokens=30)
    stack.set_control("hang")  # ignores SIGTERM, has a grandchild
    stack.start(config)
    (job,) = wait(stack.launched, 15, 0.1, "a launch")
    stack.set_control("ok")  # what the next launch will do
    wait(lambda: stack.state().history, 15, 0.1, "the timeout")
    assert stack.state().history[0].status == "timed_out"
    assert not process_alive(job["pid"])
    wait(lambda: not process_alive(job["grandchild"]), 5, 0.1, "the grandchild's end")
    assert stack.metric("tide_scheduler_retrains_finished_total", outcome="timed_out") == 1
    wait(lambda: stack.state().last_success is not None, 15, 0.1, "the next retrain")
    assert len(stack.launched()) == 2


def test_bad_configuration_exits_2_with_the_field_named(stack):
    config = stack.write_config(sample_unit="bytes")
    proc = subprocess.run([sys.executable, "-m", "tide.services.scheduler", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "schedule.sample_unit" in proc.stderr
    assert not stack.state_path.exists()  # nothing written
