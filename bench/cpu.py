"""Where a benchmark's cores went: the machine's busy CPU and the broker's, sampled from Linux /proc."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path


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
            broker = 0
            if self.broker_pid:
                fields = Path(f"/proc/{self.broker_pid}/stat").read_text().rsplit(")", 1)[1].split()
                broker = int(fields[11]) + int(fields[12])  # utime + stime
            self.samples.append((time.time(), busy / tick, broker / tick))
            if self._stop.wait(self.interval_s):
                return

    def window(self, start: float, end: float) -> dict:
        """Machine busy cores and the process's cores over [start, end], read between the samples
        that bracket it (a window shorter than the interval reads a little of its surroundings)."""
        samples = list(self.samples)
        before = [s for s in samples if s[0] <= start] or samples[:1]
        after = [s for s in samples if s[0] >= end] or samples[-1:]
        (t0, m0, b0), (t1, m1, b1) = before[-1], after[0]
        if t1 <= t0:
            return {"machine_busy_cores": float("nan"), "broker_cores": float("nan")}
        return {"machine_busy_cores": (m1 - m0) / (t1 - t0),
                "broker_cores": (b1 - b0) / (t1 - t0)}  # 0 with the broker elsewhere: none of these cores
