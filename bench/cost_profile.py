"""How repeatable the engine's start-up step-cost profile is: the same grid profiled several times.

The schedulers decide from the profile's cells until live steps move them, and a cell timed slow
at start-up is a shape they avoid and so never time again; what matters is how far two profiles of
one machine disagree cell by cell. Each profile here times every shape of the engine's grid (the
packed verify's, the drafter's; tide/spec/cost.py ``profile_shapes``) ``--reps`` times after one
warm-up, in one of two orders, alternating profile by profile so both meet the same machine:
- ``passes`` (the engine's): the whole grid ``reps`` times over, each shape's fastest kept;
- ``back-to-back``: each shape's ``reps`` runs in a row, fastest kept.
Reported per order: each cell's spread over the profiles (slowest / fastest - 1), its median and
the worst cell, over the target's forwards (verify cells) and the drafter's.

    python -m bench.cost_profile [--rows 4] [--profiles 4] [--reps 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.report import print_table, write_json
from tide.config import load_config
from tide.drafter.artifact import TargetSpec, load_drafter
from tide.drafter.static import static_drafter_path
from tide.engine.reference import load_target
from tide.spec.cost import fastest_over_passes, profile_shapes


def back_to_back(runs, reps: int) -> list[float]:
    """Each run's fastest of ``reps`` timings taken in a row after its own warm-up."""
    out = []
    with torch.inference_mode():
        for fn in runs:
            fn()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out.append(min(times))
    return out


def spreads(profiles: list[list[float]], kinds: list[str], group: set[str]) -> list[float]:
    cells = [i for i, k in enumerate(kinds) if k in group]
    return [max(p[i] for p in profiles) / min(p[i] for p in profiles) - 1 for i in cells]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4, help="the engine's most rows (max batch size)")
    ap.add_argument("--depth", type=int, default=4, help="the engine's draft length")
    ap.add_argument("--profiles", type=int, default=4, help="profiles per order")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.rows < 1 or args.depth < 1 or args.profiles < 2 or args.reps < 1 or args.context < 1:
        ap.error("--rows, --depth, --reps and --context must be >= 1 and --profiles >= 2 (a spread needs two)")
    cfg = load_config(overrides={"model": {"torch_threads": 1}})
    target, _, _ = load_target(cfg)
    drafter = load_drafter(static_drafter_path(cfg),
                           TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids))
    length = args.context + 64
    shapes = profile_shapes(target, drafter, target.new_cache(args.rows, length), drafter.new_cache(args.rows, length),
                            args.rows, args.depth, args.context, 32, True, None)
    kinds, runs = [s[0][0] for s in shapes], [fn for _, fn in shapes]
    orders = {"passes": fastest_over_passes, "back-to-back": back_to_back}
    profiles: dict[str, list[list[float]]] = {o: [] for o in orders}
    for _ in range(args.profiles):
        for name, timed in orders.items():
            profiles[name].append(timed(runs, args.reps))
    rows, out = [("order", "forwards", "cells", "median spread", "worst cell")], {}
    for name in orders:
        for label, group in (("target", {"verify", "packed"}), ("drafter", {"draft", "refeed"})):
            s = spreads(profiles[name], kinds, group)
            out[f"{name}/{label}"] = {"median_spread": statistics.median(s), "worst_spread": max(s), "cells": len(s)}
            rows.append((name, label, len(s), f"{statistics.median(s):.3f}", f"{max(s):.3f}"))
    print_table(f"step-cost profile spread over {args.profiles} profiles ({args.rows} rows, reps {args.reps})", rows)
    write_json(args.json, {"rows": args.rows, "depth": args.depth, "profiles": args.profiles, "reps": args.reps,
                           "spread": out, "shapes": [list(s[0]) for s in shapes],
                           "seconds": profiles})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
