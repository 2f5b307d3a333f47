"""Retrain as a local child process, in its own session so it outlives a scheduler restart.

Launch: the configured command plus ``[--config FILE] --result-json PATH``, stdout and stderr to a
log file, ``start_new_session`` (the job leads its own process group, and a signal meant for the
scheduler's group does not reach it). The handle records pid, process group and the kernel's start
time of the pid, so a restarted scheduler can tell "still our job" from "pid reused". The job is
confined to ``schedule.local_cpus`` at ``schedule.local_nice`` as soon as it exists (every thread
it has then; threads and processes it starts later inherit both): a retrain on the engine's
machine trains on a core of its own and yields any core it shares, so serving does not slow.

Poll: our own child -> ``Popen.poll`` (exit code known); a job adopted from an earlier scheduler
process -> /proc liveness (zombies count as gone) and the result file alone.
Kill: SIGTERM to the group, wait up to ``kill_grace_s`` for the leader, then SIGKILL the group so
grandchildren (data loader workers) die too, and return once the leader is gone (reaped if ours,
gone from /proc or a zombie if adopted).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from tide.process import pid_alive
from tide.schedule.launcher import ENV_JOB_ID, ENV_STATE_PATH, JobSpec, Outcome, outcome_from_exit

log = logging.getLogger(__name__)
_PROC = Path("/proc")


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a pid, or None if it does not exist."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    rest = text[text.rindex(")") + 2:].split()
    return rest[0], int(rest[19])


def process_start_ticks(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True if ``pid`` runs and (when given) is the same process that started at ``start_ticks``."""
    if not _PROC.is_dir():  # no procfs: fall back to signal 0 (cannot see zombies or pid reuse)
        return pid_alive(pid)
    stat = _proc_stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    return start_ticks is None or stat[1] == start_ticks


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def parse_cpus(text: str, allowed: set[int]) -> set[int]:
    """``schedule.local_cpus`` as CPU ids (an empty set: no pinning): "" none; "last" the highest
    of ``allowed`` (this process's CPUs) when there are two or more; else "2,3" or "2-3"."""
    text = text.strip()
    if not text:
        return set()
    if text == "last":
        return {max(allowed)} if len(allowed) >= 2 else set()
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus |= set(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"schedule.local_cpus: {text!r} is not 'last', '' or a list like '2,3' or '2-3'") from None
    if not cpus or not cpus <= allowed:
        raise ValueError(f"schedule.local_cpus: {text!r} names CPUs outside {sorted(allowed)}")
    return cpus


def confine(pid: int, cpus: set[int], nice: int) -> None:
    """Every thread of ``pid`` onto ``cpus`` (empty: left as is) at niceness ``nice`` (0: left as is)."""
    try:
        tids = [int(t) for t in os.listdir(_PROC / str(pid) / "task")]
    except OSError:
        tids = [pid]  # no procfs: the main thread (later threads inherit from it)
    for tid in tids:
        try:
            if cpus:
                os.sched_setaffinity(tid, cpus)
            if nice:  # never below what it inherited: only a privileged process may lower it
                os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        except (ProcessLookupError, PermissionError):  # gone already: nothing left to confine
            continue


class LocalLauncher:
    kind = "local"

    def __init__(self, command: Sequence[str], config_path: str | None, state_path: Path,
                 kill_grace_s: float = 10.0, env: Mapping[str, str] | None = None, cpus: str = "",
                 nice: int = 0) -> None:
        if not command:
            raise ValueError("schedule.command is empty")
        self.cpus = parse_cpus(cpus, os.sched_getaffinity(0))
        self.nice = nice
        self.command = [sys.executable if arg == "{python}" else arg for arg in command]
        self.config_path = str(Path(config_path).resolve()) if config_path else None
        self.state_path = str(Path(state_path).resolve())
        self.kill_grace_s = kill_grace_s
        self.env = dict(env or {})
        self._children: dict[int, subprocess.Popen] = {}

    def argv(self, spec: JobSpec) -> list[str]:
        extra = ["--config", self.config_path] if self.config_path else []
        return [*self.command, *extra, "--result-json", str(spec.result_path)]

    def launch(self, spec: JobSpec) -> dict:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        spec.result_path.unlink(missing_ok=True)  # a stale result must not pass for this job's
        env = {**os.environ, **self.env, **spec.env, ENV_JOB_ID: spec.job_id, ENV_STATE_PATH: self.state_path}
        argv = self.argv(spec)
        with open(spec.log_path, "ab") as log_file:
            proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                    close_fds=True)
        self._children[proc.pid] = proc
        confine(proc.pid, self.cpus, self.nice)
        log.info("launched retrain %s: pid %d: %s (log %s)", spec.job_id, proc.pid,
                 " ".join(argv), spec.log_path)
        return self._handle(proc.pid, spec.result_path, spec.log_path)

    @staticmethod
    def _handle(pid: int, result_path: Path | str, log_path: Path | str) -> dict:
        return {"pid": pid, "pgid": pid, "start_ticks": process_start_ticks(pid),
                "result_path": str(result_path), "log_path": str(log_path)}

    def poll(self, handle: Mapping[str, Any]) -> Outcome | None:
        pid = int(handle["pid"])
        proc = self._children.get(pid)
        if proc is not None:
            code = proc.poll()
            if code is None:
                return None
            del self._children[pid]
            self._signal_group(int(handle["pgid"]), signal.SIGKILL)  # leftovers of the job
            return outcome_from_exit(code, handle.get("result_path"))
        if process_alive(pid, handle.get("start_ticks")):
            return None
        return outcome_from_exit(None, handle.get("result_path"))

    def kill(self, handle: Mapping[str, Any]) -> None:
        pid, pgid = int(handle["pid"]), int(handle["pgid"])
        proc = self._children.pop(pid, None)
        if proc is None and not process_alive(pid, handle.get("start_ticks")):
            return  # gone already, or the pid now belongs to someone else: signal nobody
        self._signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                break
            if proc is None and not process_alive(pid):
                break
            time.sleep(0.05)
        self._signal_group(pgid, signal.SIGKILL)
        if proc is not None:
            proc.wait(timeout=30)
        else:  # adopted, not our child to wait on: SIGKILL lands asynchronously, so wait until
            # it has (a "cancelled" record must not name a process that still runs)
            deadline = time.monotonic() + self.kill_grace_s
            while process_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        log.warning("killed retrain process group %d", pgid)

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def find(self, job_id: str) -> dict | None:
        return next((h for jid, h in self.find_active() if jid == job_id), None)

    def find_active(self) -> list[tuple[str, dict]]:
        """Group leaders whose environment marks them as jobs launched for this state file."""
        found = []
        if not _PROC.is_dir():
            return found
        for entry in _PROC.iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            env = _environ(pid)
            job_id = env.get(ENV_JOB_ID)
            if not job_id or env.get(ENV_STATE_PATH) != self.state_path:
                continue
            try:
                if os.getpgid(pid) != pid:  # its children inherit the markers too
                    continue
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except (ProcessLookupError, OSError):
                continue
            if not process_alive(pid):
                continue
            result = argv[argv.index("--result-json") + 1] if "--result-json" in argv[:-1] else None
            found.append((job_id, self._handle(pid, result or "", "")))
        return found
