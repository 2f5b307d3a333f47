"""How much of a retrain's weight change the registered candidate keeps.

A retrain registers the parent plus ``train.update_fraction`` of its change (WiSE-FT,
``keep_update_``): below 1 it gives up a little of the new traffic's gain for much
of what the old traffic would lose. One fraction does not suit every window: a new workload far from
the old one pulls the weights harder, and the same fraction then gives up more of the old traffic.

With ``train.keep_workloads`` > 0 the retrain checks the candidate on its held-out requests by
workload tag: while a tag measured on at least ``train.keep_min_positions`` positions keeps less than
``keep_workloads`` x the parent's simulated acceptance, the fraction steps down by ``FRACTION_STEP``,
to ``train.min_update_fraction`` at the lowest (whose candidate is registered if none keeps enough).
Tags with fewer positions are too few requests to steer by: they never step it down. The new
workload gains over the parent, so only a workload the candidate loses can hold it back.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch

from tide.drafter.artifact import round_weights_
from tide.drafter.model import Eagle3Drafter
from tide.train.trainer import EvalResult

FRACTION_STEP = 0.1  # fine enough to stop near the bound, coarse enough to evaluate only a few times


@dataclass
class Kept:
    """The candidate registered: its weights, the fraction of the change it kept, its evaluation."""

    drafter: torch.nn.Module
    fraction: float
    evaluation: EvalResult
    tried: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (fraction, tags short)

    def describe(self) -> str:
        """"0.6: chat 0.951; 0.5: none short" (each tag under the bound: its share of the parent's)."""
        return "; ".join(f"{f:g}: " + (", ".join(f"{t} {r:.3f}" for t, r in short.items()) or "none short")
                         for f, short in self.tried)


@torch.no_grad()
def keep_update_(drafter: Eagle3Drafter, parent: Eagle3Drafter, fraction: float) -> None:
    """θ ← θ₀ + fraction·(θ − θ₀) after training (WiSE-FT, Wortsman et al. 2022): the candidate
    keeps ``fraction`` of its change from ``parent``. Along that line the new traffic's gain falls
    more slowly than the old traffic's loss (docs/benchmarks.md), so a fraction below 1 buys back
    old-workload acceptance cheaply. Parameters only: the vocab mapping is a buffer and stays."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the update fraction must be in (0, 1], got {fraction}")
    if fraction == 1.0:
        return
    start = dict(parent.named_parameters())
    for name, p in drafter.named_parameters():
        if name in start:  # a head the candidate has and the parent lacks is new: kept whole
            p0 = start[name].to(p.device, p.dtype)
            p.copy_(p0 + fraction * (p - p0))


def fractions_to_try(start: float, floor: float) -> list[float]:
    """``start``, then down by ``FRACTION_STEP`` while above ``floor``, then ``floor``."""
    out = [start]
    while out[-1] - FRACTION_STEP > floor + 1e-9:
        out.append(round(out[-1] - FRACTION_STEP, 6))
    if floor < out[-1] - 1e-9:
        out.append(floor)
    return out


def short_workloads(candidate: EvalResult, parent: EvalResult, keep: float, min_positions: int) -> dict[str, float]:
    """{tag: candidate / parent} for each tag measured on ``min_positions`` or more that keeps under ``keep``."""
    out = {}
    for tag, (acc, positions) in candidate.by_group.items():
        if positions >= min_positions and tag in parent.by_group:
            share = acc / parent.by_group[tag][0]
            if share < keep:
                out[tag] = share
    return out


def keep_fraction(trained: torch.nn.Module, parent: torch.nn.Module, evaluate: Callable[[torch.nn.Module], EvalResult],
                  parent_eval: EvalResult, tc) -> Kept:
    """The candidate to register from ``trained``: ``tc.update_fraction`` of the change, or less while a
    workload keeps under ``tc.keep_workloads`` of ``parent_eval`` (module docstring). Each candidate is
    rounded to bfloat16 before it is evaluated, as it is stored and served. The last fraction tried is
    applied to ``trained`` in place: with the check off, no copy of the drafter is made."""
    fractions = fractions_to_try(tc.update_fraction, tc.min_update_fraction) if tc.keep_workloads > 0 \
        else [tc.update_fraction]
    tried = []
    for i, fraction in enumerate(fractions):
        candidate = trained if i == len(fractions) - 1 else copy.deepcopy(trained)
        keep_update_(candidate, parent, fraction)
        round_weights_(candidate, torch.bfloat16)
        evaluation = evaluate(candidate)
        short = short_workloads(evaluation, parent_eval, tc.keep_workloads, tc.keep_min_positions) \
            if tc.keep_workloads > 0 else {}
        tried.append((fraction, short))
        if not short:
            break
    return Kept(candidate, fraction, evaluation, tried)
