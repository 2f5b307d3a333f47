"""The per-phase memory recorder: each phase reports its own peak, not the process's so far, and
the process peak survives the resets (which also lower what getrusage reports)."""
from __future__ import annotations

import pytest
import torch

from tide.train import memory
from tide.train.memory import PhaseMemory

MIB = 1024**2  # the recorder reads /proc: TIDE runs on Linux only


def _touch(mib: int) -> None:
    """Allocate and write ``mib`` MiB, then free them."""
    x = torch.ones(mib * MIB // 4)
    x.add_(1.0)
    del x


def test_each_phase_reports_its_own_peak_and_the_process_peak_is_kept():
    rec = PhaseMemory()
    with rec.phase("big"):
        _touch(400)
    with rec.phase("small"):
        _touch(40)
    assert rec.exact, "clear_refs must be writable on the test machine"
    big, small = rec.peaks_gib["big"], rec.peaks_gib["small"]
    # the 400 MiB phase peaks >= 350 MiB above where the small one does: its mark was reset
    assert big - small > 350 / 1024, rec.peaks_gib
    assert rec.end_rss_gib["small"] < big - 350 / 1024  # freed and trimmed after the big phase
    assert rec.process_peak_gib >= big  # across the reset, which getrusage does not see
    assert list(rec.metrics()) == ["peak_rss_gib.big", "peak_rss_gib.small", "peak_rss_gib", "peak_rss_gib_exact"]
    assert rec.heaviest == "big"


def test_a_repeated_phase_keeps_its_largest_peak():
    rec = PhaseMemory()
    with rec.phase("eval"):
        _touch(300)
    with rec.phase("eval"):
        _touch(10)
    with rec.phase("other"):
        pass
    assert rec.peaks_gib["eval"] - rec.peaks_gib["other"] > 250 / 1024


def test_without_clear_refs_phases_report_the_peak_so_far(monkeypatch):
    monkeypatch.setattr(memory, "reset_high_water", lambda: False)
    rec = PhaseMemory()
    with rec.phase("a"):
        _touch(200)
    with rec.phase("b"):
        pass
    assert not rec.exact and rec.metrics()["peak_rss_gib_exact"] == 0.0
    assert rec.peaks_gib["b"] >= rec.peaks_gib["a"]  # monotone: an upper bound, never an undercount


def test_a_phase_that_raises_is_still_recorded():
    rec = PhaseMemory()
    with pytest.raises(RuntimeError):
        with rec.phase("boom"):
            raise RuntimeError("x")
    assert "boom" in rec.peaks_gib and "boom" in rec.end_rss_gib
