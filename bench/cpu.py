"""Where a benchmark's cores went, from Linux /proc: a process's and its threads' CPU seconds, and the
machine's busy CPU beside one process's over a window known only afterwards (``CpuMeter``)."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) per Python thread name of this process (native threads that
    Python did not start, e.g. torch's, are summed as "<native>")."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = names.get(int(task.name), "<native>")
        name = "<request client threads>" if name.startswith("Thread-") else name
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) of process ``pid``; 0 for none or one that is gone."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Samples the machine's busy CPU-seconds and the broker's (Linux /proc) every ``interval_s``, so a
    window known only afterwards (a phase's steady window) can be read: where the cores went."""

    def __init__(self, broker_pid: int | None, interval_s: float = 0.25) -> None:
        self.broker_pid, self.interval_s = broker_pid, interval_s
        self.samples: list[tuple[float, float, float]] = []  # (time.time(), machine busy s, broker s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def __enter__(self) -> "CpuMeter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while True:
            # user nice system idle iowait irq softirq steal (guest time is inside user already)
            cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
            busy = sum(cpu) - cpu[3] - cpu[4]
            self.samples.append((time.time(), busy / tick, process_cpu_s(self.broker_pid)))
            if self._stop.wait(self.interval_s):
                return

    def window(self, start: float, end: float) -> dict:
        """Machine busy cores and the broker's over [start, end], read between the samples
        that bracket it (a window shorter than the interval reads a little of its surroundings)."""
        samples = list(self.samples)
        if not samples:
            return {"machine_busy_cores": float("nan"), "broker_cores": float("nan")}
        before = [s for s in samples if s[0] <= start] or samples[:1]
        after = [s for s in samples if s[0] >= end] or samples[-1:]
        (t0, m0, b0), (t1, m1, b1) = before[-1], after[0]
        if t1 <= t0:
            return {"machine_busy_cores": float("nan"), "broker_cores": float("nan")}
        return {"machine_busy_cores": (m1 - m0) / (t1 - t0),
                "broker_cores": (b1 - b0) / (t1 - t0)}  # 0 with the broker elsewhere: none of these cores
