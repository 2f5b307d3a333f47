"""Which kernel computes the target's linears on this machine: checked and timed once at start-up.

Two candidates compute ``y = x @ W.T`` for the few-row products of decode and verify:
- ``rows``: the C kernel (``rowkernel.py``), batch-invariant by construction, AVX2 + one thread;
- ``onednn``: torch's oneDNN with weights reordered once at load, rows padded to ``ONEDNN_MIN_ROWS``
  (``Linears``). How fast it is, and whether a row's result is the same at every row count,
  depends on the CPU and the oneDNN build: it is measured here, not assumed.

The lossless guarantee rests on a decode and a verify computing a token alike (greedy output equal
to the target alone's), so a candidate is eligible only if every row count it serves gives each row
bitwise what that row gives alone. Among the eligible, ``choose`` takes the one with the smaller
summed time of a pass over every weight at the row counts decode and verify use. The choice is
kept per process and weight shapes: every target built in one process (engine, retrain) computes
alike.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

Linear = Callable[[torch.Tensor, str], torch.Tensor]  # (x [M, K], weight name) -> [M, N]

# decode (1), short and deep verifies, batches of verifies: the row counts a step runs
TIMED_ROWS = (1, 2, 4, 8, 16)
TIMING_REPEATS = 3
_chosen: dict[tuple, "Choice"] = {}


@dataclass(frozen=True)
class Choice:
    kernel: str  # "rows" | "onednn"
    pass_ms: dict[str, float]  # candidate -> summed ms of a pass over every weight at TIMED_ROWS
    invariant: dict[str, bool]  # candidate -> every row count gives each row its own result bitwise


def batch_invariant(linear: Linear, shapes: dict[str, torch.Size], max_rows: int) -> bool:
    """Each row's output, alone and inside blocks of 2..``max_rows`` rows, bitwise alike (one
    weight per distinct shape: a kernel's code path depends on the shape, not the values)."""
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        x = torch.randn(max_rows, shape[1], generator=g)
        alone = torch.cat([linear(x[i:i + 1], name) for i in range(max_rows)])
        for m in sorted({2, 3, 5, max_rows}):
            if not torch.equal(linear(x[:m], name), alone[:m]):
                return False
    return True


def pass_ms(linear: Linear, shapes: dict[str, torch.Size], names: Sequence[str]) -> float:
    """Summed over ``TIMED_ROWS``: the median ms of one product by every weight in ``names``."""
    g = torch.Generator().manual_seed(1)
    inputs = {k: torch.randn(max(TIMED_ROWS), k, generator=g) for k in {s[1] for s in shapes.values()}}
    total = 0.0
    for m in TIMED_ROWS:
        times = []
        for _ in range(TIMING_REPEATS):
            t0 = time.perf_counter()
            for name in names:
                linear(inputs[shapes[name][1]][:m], name)
            times.append(time.perf_counter() - t0)
        total += statistics.median(times) * 1e3
    return total


def choose(candidates: dict[str, Linear], weights: dict[str, torch.Tensor], names: Sequence[str],
           max_rows: dict[str, int]) -> Choice:
    """The faster eligible candidate (none eligible: ``rows`` if offered, else the first);
    ``max_rows``: how many rows each candidate serves (checked up to there)."""
    shapes = {n: weights[n].shape for n in names}
    key = (tuple(candidates), tuple(sorted((n, tuple(s)) for n, s in shapes.items())), torch.get_num_threads())
    if key in _chosen:
        return _chosen[key]
    distinct = {tuple(s): n for n, s in shapes.items()}  # one weight per shape
    one_each = {n: shapes[n] for n in distinct.values()}
    invariant = {c: batch_invariant(fn, one_each, max_rows[c]) for c, fn in candidates.items()}
    timed = {c: pass_ms(fn, shapes, names) for c, fn in candidates.items()}
    eligible = [c for c in candidates if invariant[c]]
    if eligible:
        kernel = min(eligible, key=timed.__getitem__)
    else:
        kernel = "rows" if "rows" in candidates else next(iter(candidates))
    choice = _chosen[key] = Choice(kernel, timed, invariant)
    log.info("target linears: %s (ms per pass over %s rows: %s; batch-invariant: %s)", kernel,
             "/".join(map(str, TIMED_ROWS)), {c: round(v, 1) for c, v in timed.items()}, invariant)
    return choice
