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
class ShiftRecord:
    """A detected workload shift (tide/schedule/shift.py) and the retrain it triggered."""

    signal: str  # workload_mix | acceptance_drop
    detected_at_s: float
    detail: str  # what changed, in words
    workloads: list[str] = field(default_factory=list)  # the workloads that grew (mix signal)
    # capture time where the new traffic starts (mix: its oldest row; acceptance: the reading's start)
    since_s: float | None = None
    job_id: str | None = None  # the retrain it triggered (None: not launched yet)
    launched_at_s: float | None = None
    status: str | None = None  # that retrain's outcome once it ended
    version: str | None = None  # the version it registered

    @property
    def pending(self) -> bool:
        """Detected, its retrain not launched yet: the next launch is the shift's."""
        return self.job_id is None


@dataclass
class SchedulerState:
    running: RunningJob | None = None
    last_success: FinishedJob | None = None
    consecutive_failures: int = 0
    last_failure_at_s: float | None = None
    launched_total: int = 0
    history: list[FinishedJob] = field(default_factory=list)  # newest last
    shifts: list[ShiftRecord] = field(default_factory=list)  # detected shifts, newest last

    @property
    def shift(self) -> ShiftRecord | None:
        return self.shifts[-1] if self.shifts else None

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
                   history=[FinishedJob(**_v2(h)) for h in data.get("history", [])],
                   shifts=[ShiftRecord(**h) for h in data.get("shifts", [])])


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


def jobs_report(state_path: str | Path, shift_at_s: float | None = None) -> list[dict[str, Any]]:
    """The finished retrains of a state file with what their result files say (beside it, in
    ``jobs/``): launched and finished seconds after ``shift_at_s`` (a unix time, when given), wall
    and training seconds, CPU seconds and share of the machine, the CPUs it ran on, its version."""
    from tide.schedule.launcher import read_result

    state = StateStore(state_path).load()
    shift_jobs = {s.job_id for s in state.shifts}
    out = []
    for job in state.history:
        result, _ = read_result(Path(state_path).parent / "jobs" / f"{job.job_id}.result.json")
        m = result.get("metrics") or {}
        wall_s = job.finished_at_s - job.started_at_s
        cpu_s = m.get("cpu_s")
        out.append({
            "job": job.job_id, "shift": job.job_id in shift_jobs, "status": job.status, "version": job.version,
            "launched_after_shift_s": None if shift_at_s is None else round(job.started_at_s - shift_at_s, 1),
            "finished_after_shift_s": None if shift_at_s is None else round(job.finished_at_s - shift_at_s, 1),
            "wall_s": round(wall_s, 1), "train_wall_s": m.get("train_wall_s"),
            "train_tokens": m.get("train_tokens_seen"), "recent_requests": m.get("recent_requests"),
            "replay_requests": m.get("replay_requests"), "rehearsal_requests": m.get("rehearsal_requests"),
            "cpu_s": cpu_s, "cpus": m.get("cpus"),
            "machine_share": None if cpu_s is None else round(cpu_s / max(1e-9, wall_s * (os.cpu_count() or 1)), 3),
            "sim_accept": [m.get("champion_sim_accept_length"), m.get("candidate_sim_accept_length")],
            "sim_accept_by_workload": _by_workload(m)})
    return out


def _by_workload(metrics: dict) -> dict[str, list]:
    """{tag: [champion, candidate, held-out positions]} from a retrain's per-workload metrics."""
    tags = [k.split(".", 1)[1] for k in metrics if k.startswith("heldout_positions.")]
    return {t: [metrics.get(f"champion_sim_accept_length.{t}"), metrics.get(f"candidate_sim_accept_length.{t}"),
                metrics[f"heldout_positions.{t}"]] for t in tags}
