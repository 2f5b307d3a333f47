"""Target forward cost by number of query tokens: the row kernel vs torch's kernels, one run.

What speculative decoding pays per step on CPU is the verify/decode cost ratio: a forward over
γ+1 new tokens against a 1-token decode, at the same cache length. Both SmolLM2 instances (one
with the row kernel, one on oneDNN with prepacked weights, tide/models/llama.py ``Linears``) get
the same random context; each round times every (kernel, q) pair in turn, so machine drift hits
all alike. Prints median ms per forward, each setting's ratio to its own q=1, and the kernel the
engine's default (``model.linear_kernel: auto``) picks here.

    python -m bench.forward [--context 200] [--rounds 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.report import print_table, write_json
from tide.config import load_config
from tide.models.checkpoint import ensure_target_checkpoint
from tide.models.llama import LlamaTarget


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the timed forward")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--queries", default="1,2,3,5,8", help="query lengths to time (comma-separated)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config()
    folder = ensure_target_checkpoint(cfg.home_path, cfg.model.target)
    targets = {"row kernel": LlamaTarget.from_folder(folder, kernel="rows"),
               "onednn": LlamaTarget.from_folder(folder, kernel="onednn")}
    if targets["row kernel"].linear.rows is None:
        print("row kernel unavailable here (no AVX2/FMA or no C compiler): both columns use torch", file=sys.stderr)
    auto = LlamaTarget.from_folder(folder).linear
    chosen = auto.choice.kernel if auto.choice is not None else auto.kernel
    queries = [int(q) for q in args.queries.split(",")]
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, 40000, (1, args.context), generator=g)
    caches = {}
    for name, t in targets.items():
        caches[name] = t.new_cache(1, args.context + 64)
        t.forward(context, torch.tensor([0]), caches[name], torch.tensor([0]))
    times: dict[tuple[str, int], list[float]] = {(n, q): [] for n in targets for q in queries}
    for _ in range(args.rounds):
        for q in queries:
            x = torch.randint(0, 40000, (1, q), generator=g)
            for name, t in targets.items():
                t0 = time.perf_counter()
                # the same position every time: the cache slots past it are simply overwritten
                t.forward(x, torch.tensor([args.context]), caches[name], torch.tensor([0]))
                times[(name, q)].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [("query tokens", *[f"{n} ms" for n in targets], *[f"{n} / own q=1" for n in targets])]
    for q in queries:
        rows.append((q, *[f"{med[(n, q)]:.1f}" for n in targets],
                     *[f"{med[(n, q)] / med[(n, queries[0])]:.2f}x" for n in targets]))
    print_table(f"SmolLM2 forward, {args.context} cached tokens, 1 thread, median of {args.rounds}", rows)
    print(f"model.linear_kernel auto picks here: {chosen}"
          + (f" (linears-only ms per pass over rows 1/2/4/8/16: {auto.choice.pass_ms}, batch-invariant: "
             f"{auto.choice.invariant})" if auto.choice is not None else ""))
    write_json(args.json, {"context": args.context, "rounds": args.rounds,
                           "median_ms": {f"{n}/q{q}": v for (n, q), v in med.items()},
                           "row_kernel": targets["row kernel"].linear.rows is not None, "auto_picks": chosen})
    return 0


if __name__ == "__main__":
    sys.exit(main())
