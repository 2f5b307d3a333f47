"""Scheduler test helpers: the retrain stub command and a real dataset table to fill."""
import json
import sys
import time
from pathlib import Path

import pytest
from stubs import retrain_stub
from stubs.retrain_stub import kill_stubs

from tide.config import ScheduleConfig
from tide.dataset.table import DatasetTable

STUB = Path(retrain_stub.__file__)  # run as a script: the scheduler launches a command line


class Kit:
    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.launches = tmp_path / "launches.jsonl"
        self.control = tmp_path / "control.json"
        self.state_path = tmp_path / "sched" / "state.json"
        self.table = DatasetTable(tmp_path / "dataset")

    def command(self) -> tuple[str, ...]:
        return (sys.executable, str(STUB), "--launches", str(self.launches),
                "--control", str(self.control), "--data-dir", self.table.uri)

    def set_control(self, mode: str, sleep_s: float = 0.0, gate: str | None = None) -> Path | None:
        """What the next launches do; with ``gate`` (a folder name), they read the dataset when the
        test creates ``<gate>/read`` and end when it creates ``<gate>/finish`` (see the stub)."""
        folder = None
        if gate is not None:
            folder = self.tmp / gate
            folder.mkdir()
        self.control.write_text(json.dumps({"mode": mode, "sleep_s": sleep_s,
                                            "gate": None if folder is None else str(folder)}))
        return folder

    def launched(self) -> list[dict]:
        if not self.launches.exists():
            return []
        return [json.loads(line) for line in self.launches.read_text().splitlines()]

    def add_file(self, tokens: int, model: str = "org/m", rows: int = 4, requests: int = 2) -> int:
        """One ingest commit as the scheduler sees it (its counts in the log; the scheduler opens no
        data file); returns the table version it made."""
        self.table.ensure()
        return self.table.append([], {model: {"rows": rows, "requests": requests, "tokens": tokens,
                                              "generated_tokens": tokens // 2}})

    def config(self, **overrides) -> ScheduleConfig:
        base = dict(interval_s=0.2, min_new_samples=100, cooldown_s=0.0, job_timeout_s=30.0,
                    kill_grace_s=0.5, backoff_base_s=10.0, backoff_max_s=100.0,
                    command=self.command(), state_path=str(self.state_path))
        base.update(overrides)
        return ScheduleConfig(**base)


@pytest.fixture
def kit(tmp_path):
    k = Kit(tmp_path)
    yield k
    kill_stubs(k.launched(), k.state_path)


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05, what: str = "it"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture
def until():
    return wait_until
