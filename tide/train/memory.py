"""Peak resident memory per phase of one process (a retrain: window load, training, evaluation...).

Linux keeps one high-water mark of a process's resident set (``VmHWM`` in /proc/self/status),
and writing "5" to /proc/self/clear_refs resets it to the current RSS. ``PhaseMemory.phase``:
1. at the start, reads the mark (the peak since the last reset, folded into the process peak),
   then resets it;
2. at the end, reads the mark again: the phase's own peak, exact (the kernel tracks every page,
   no sampling), plus the RSS left when the phase ends;
3. hands freed heap back to the system (``malloc_trim``) so that what a phase freed does not
   count against the next one.
The reset also lowers what ``getrusage`` and a parent's ``wait4`` report as the process's maximum
RSS (both read the same mark), so whoever measures the process from outside must take
``PhaseMemory.process_peak_gib`` (every interval's peak, folded), not ``ru_maxrss`` alone.
Where clear_refs cannot be written (not Linux, a locked-down /proc) the phases report the
process peak so far (monotone, an upper bound of each phase's own peak) and ``exact`` is False.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

GIB = 1024**3
METRIC_PREFIX = "peak_rss_gib"
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(key: str) -> int | None:
    """A ``Vm*`` line of /proc/self/status in KiB (None where there is no such file)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_gib() -> float:
    """The current resident set (0.0 where /proc is missing)."""
    return (_status_kib("VmRSS") or 0) * 1024 / GIB


def high_water_gib() -> float:
    """The resident high-water mark since the last reset (else since the process started)."""
    kib = _status_kib("VmHWM")
    if kib is None:  # ru_maxrss is KiB on Linux
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024 / GIB


def reset_high_water() -> bool:
    """Reset the mark to the current RSS; False where the kernel does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Return freed heap pages to the system (glibc keeps them mapped otherwise)."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to trim this way
        pass


@dataclass
class PhaseMemory:
    """Per-phase peaks (GiB) in the order the phases ran; a phase that runs twice keeps its max."""

    peaks_gib: dict[str, float] = field(default_factory=dict)
    end_rss_gib: dict[str, float] = field(default_factory=dict)
    exact: bool = True
    _process_peak_gib: float = 0.0

    @contextmanager
    def phase(self, name: str):
        self._fold_and_reset()
        try:
            yield
        finally:
            peak = high_water_gib()
            if not self.exact:
                # "the peak so far" must not fall: the kernel folds the current RSS into VmHWM
                # only when read, so a figure read before the heap was trimmed can exceed a later one
                peak = max(peak, self._process_peak_gib)
            self._process_peak_gib = max(self._process_peak_gib, peak)
            self.peaks_gib[name] = max(self.peaks_gib.get(name, 0.0), peak)
            trim_heap()
            self.end_rss_gib[name] = rss_gib()
            log.info("memory: %s peak %.2f GiB, %.2f GiB resident after", name, peak,
                     self.end_rss_gib[name])

    def _fold_and_reset(self) -> None:
        self._process_peak_gib = max(self._process_peak_gib, high_water_gib())
        if self.exact and not reset_high_water():
            self.exact = False
            log.info("memory: cannot reset the RSS high-water mark here; phases show the peak so far")

    @property
    def process_peak_gib(self) -> float:
        """The peak over the whole process so far, across every reset."""
        return max(self._process_peak_gib, high_water_gib())

    @property
    def heaviest(self) -> str:
        return max(self.peaks_gib, key=self.peaks_gib.get) if self.peaks_gib else ""

    def metrics(self) -> dict[str, float]:
        """MLflow metrics: ``peak_rss_gib.<phase>`` for each phase, ``peak_rss_gib`` overall."""
        out = {f"{METRIC_PREFIX}.{name}": round(v, 4) for name, v in self.peaks_gib.items()}
        out[METRIC_PREFIX] = round(self.process_peak_gib, 4)
        out[f"{METRIC_PREFIX}_exact"] = float(self.exact)
        return out
