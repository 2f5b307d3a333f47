"""The scheduler's persistent state and lease: one JSON file guarded by an fcntl lock.

The file says which retrain runs (its launcher handle), when the last one succeeded and up to which
dataset table version (the watermark), and the failure streak that drives backoff. Single flight rests on two rules:
1. every read-decide-launch-write happens inside ``transaction()``, which holds an exclusive
   ``flock`` on ``<state>.lock``: two scheduler processes (a restart overlapping the old one, two
   replicas) serialise, and the second sees the first's running job;
2. a job is written as "launching" (no handle) before it starts and with its handle right after,
   so a crash between the two leaves a record the next scheduler resolves instead of forgetting.
Writes are atomic (temporary file, fsync, rename, fsync of the directory). A corrupt file stops
the scheduler with an error naming it rather than being replaced: replacing it could forget a
running job and launch a second.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

STATE_VERSION = 2  # 1: watermarks were index times (read as none: everything counts once)


class StateError(RuntimeError):
    """The state file cannot be read; the message names it."""


@dataclass
class RunningJob:
    job_id: str
    launcher: str
    started_at_s: float
    deadline_s: float
    # the newest table version at launch: where the watermark moves if this job succeeds without
    # reporting what it read (None = no table yet)
    watermark_version: int | None
    new_samples: int
    handle: dict | None = None  # None = launch in progress (or interrupted)


@dataclass
class FinishedJob:
    job_id: str
    launcher: str
    started_at_s: float
    finished_at_s: float
    status: str  # succeeded | failed | timed_out
    reason: str
    # a success: the watermark after it (the table version the job read); else as launched
    watermark_version: int | None = None
    new_samples: int = 0
    exit_code: int | None = None
    version: str | None = None
    run_id: str | None = None


@dataclass
class SchedulerState:
    running: RunningJob | None = None
    last_success: FinishedJob | None = None
    consecutive_failures: int = 0
    last_failure_at_s: float | None = None
    launched_total: int = 0
    history: list[FinishedJob] = field(default_factory=list)  # newest last

    def to_json(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SchedulerState":
        if data.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"state version {data.get('version')!r}, expected {STATE_VERSION}")
        running = _v2(data.get("running"))
        last = _v2(data.get("last_success"))
        return cls(running=RunningJob(**running) if running else None,
                   last_success=FinishedJob(**last) if last else None,
                   consecutive_failures=int(data.get("consecutive_failures", 0)),
                   last_failure_at_s=data.get("last_failure_at_s"),
                   launched_total=int(data.get("launched_total", 0)),
                   history=[FinishedJob(**_v2(h)) for h in data.get("history", [])])


def _v2(job: dict | None) -> dict | None:
    """A version-1 job record: its index-time watermark means nothing to the table's log."""
    if job is None or "watermark_s" not in job:
        return job
    return {**{k: v for k, v in job.items() if k != "watermark_s"}, "watermark_version": None}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StateStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def load(self) -> SchedulerState:
        """Read without the lock (a consistent snapshot: writes are atomic renames)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return SchedulerState()
        try:
            return SchedulerState.from_json(json.loads(text))
        except (ValueError, TypeError, KeyError) as exc:
            raise StateError(f"scheduler state {self.path} is unreadable ({exc}); fix or move it "
                             "aside after checking that no retrain job is running") from exc

    def save(self, state: SchedulerState) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(state.to_json(), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[SchedulerState]:
        """Exclusive lock, load, yield the state to change, save it (also when the body raised:
        a job launched before the error must stay recorded)."""
        with open(self.lock_path, "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                state = self.load()
                try:
                    yield state
                finally:
                    self.save(state)
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def checkpoint(self, state: SchedulerState) -> None:
        """Save inside a transaction before a step that may not return (a launch)."""
        self.save(state)
