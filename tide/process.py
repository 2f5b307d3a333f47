"""Child processes for ``tide demo``/``tide up``: start with a log file, wait healthy, stop cleanly.

Each service runs as its own process (``python -m tide.services.<name>``) with its own log file;
stop sends SIGTERM, waits, and escalates to SIGKILL only after ``stop_timeout_s``.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def pid_alive(pid: int) -> bool:
    """Signal 0: does ``pid`` exist (PermissionError means it does, owned by someone else)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_or_free(preferred: int | None) -> int:
    """``preferred`` when it can be bound on loopback now, else a free port: the stack's fixed
    defaults (engine 8000, MLflow 5000, ...) are easy to remember, but another stack, test or
    program may hold them. (The check races with other binders; the service's start then fails
    loudly rather than sharing a port.)"""
    if not preferred:
        return free_port()
    with socket.socket() as s:
        # as servers bind (uvicorn, http.server, Prometheus): a port in TIME_WAIT is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            return free_port()
    return preferred


@dataclass
class ServiceProcess:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    health_url: str | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> "ServiceProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        # the caller's working directory: services are modules of the installed package, so
        # nothing depends on where a checkout lies
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        return self

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   + self.tail())
            if self.health_url is None:
                return
            try:
                if httpx.get(self.health_url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s:.0f}s; see {self.log_path}")

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, stop_timeout_s: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


def python_service(name: str, module: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                   health_url: str | None = None) -> ServiceProcess:
    """``python -m module args`` with this interpreter (e.g. ``tide.services.engine``)."""
    return ServiceProcess(name, [sys.executable, "-m", module, *args], log_dir / f"{name}.log",
                          env or {}, health_url)
