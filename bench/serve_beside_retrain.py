"""Served tok/s of the demo's engine while a retrain runs beside it, against the same traffic without.

On a finished demo's home (``--home <TIDE_HOME>/demo``: its config, dataset and drafters):
1. the engine as the demo runs it (``tide serve`` on the home's config: the default scheduler, draft
   length and stop rule), serving the static drafter (or ``--drafter``), capture off, no registry;
2. rounds of the demo's phase-2 traffic (the same code prompts every round, concurrency 6, 64
   tokens, greedy), in pairs: one with nothing else running, one with a retrain running beside it
   (``tide train --online`` on the home's dataset, launched by the scheduler's own local launcher:
   ``schedule.local_cpus`` at ``schedule.local_nice``, or unconfined with ``--unconfined``;
   registering into a scratch registry). A retrain round starts once the job trains (its log says
   so) and the job is stopped after it; the order within a pair alternates, so drift in the
   machine's load hits both sides alike;
3. tok/s of a round = completion tokens / its wall time; the figure: with / without, the ratio of
   sums over all pairs with a 90% bootstrap interval over pairs.

    python -m bench.serve_beside_retrain --home $TIDE_HOME/demo [--pairs 4] [--requests 36] [--unconfined] [--json out.json]
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import yaml

from bench.report import print_table, write_json
from tide.comparison import load_prompts
from tide.config import load_config
from tide.process import free_port, python_service
from tide.schedule.launcher import JobSpec
from tide.schedule.local_launcher import LocalLauncher
from tide.traffic import replay

TRAINING_LINE = "retrain: training (parent sim accept length"  # tide/train/online.py, once it trains


def engine_config(home: Path, scratch: Path, drafter: str) -> Path:
    """The home's config with capture off, no registry followed, the given drafter serving."""
    cfg = yaml.safe_load((home / "run" / "tide.yaml").read_text())
    cfg["capture"] = {**cfg.get("capture", {}), "enabled": False}
    cfg["ops"] = {**cfg.get("ops", {}), "follow_registry": False, "alias_owner_url": ""}
    cfg["drafter"] = {"path": drafter}
    path = scratch / "engine.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_retrain(home: Path, scratch: Path, cpus: str, nice: int, n: int, timeout_s: float = 600.0):
    """A retrain on the home's data, as the scheduler launches one; returns (launcher, handle) once it trains."""
    launcher = LocalLauncher(("{python}", "-m", "tide.cli", "train", "--online"), str(home / "run" / "tide.yaml"),
                             scratch / f"state-{n}.json", kill_grace_s=5.0, cpus=cpus, nice=nice,
                             env={"TIDE_REGISTRY__TRACKING_URI": f"sqlite:///{scratch}/mlflow-{n}.db",
                                  "TIDE_REGISTRY__REGISTRY_URI": "", "TIDE_OPS__AUTO_PROMOTE": "false",
                                  "TIDE_OPS__ALIAS_OWNER_URL": "", "TIDE_TRAIN__MAX_TRAIN_S": "3600",
                                  "TIDE_TRAIN__EPOCHS": "100"})
    spec = JobSpec(f"bench-{n}", scratch / f"result-{n}.json", scratch / f"retrain-{n}.log")
    handle = launcher.launch(spec)
    deadline = time.monotonic() + timeout_s
    while TRAINING_LINE not in (spec.log_path.read_text(errors="replace") if spec.log_path.exists() else ""):
        if launcher.poll(handle) is not None or time.monotonic() > deadline:
            launcher.kill(handle)
            raise SystemExit(f"the retrain did not reach training; see {spec.log_path}")
        time.sleep(0.5)  # polling its log: the event is a line in it
    return launcher, handle


def one_round(url: str, prompts, requests: int, concurrency: int, max_tokens: int) -> float:
    t0 = time.monotonic()
    res = replay(url, prompts[:requests], concurrency, max_tokens)
    if res.failed:
        raise SystemExit(f"{res.failed} requests failed: {res.errors[:3]}")
    return res.completion_tokens / (time.monotonic() - t0)


def bootstrap(pairs: list[tuple[float, float]], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """90% interval of sum(with) / sum(without) over pairs drawn with replacement."""
    rng, out = random.Random(seed), []
    for _ in range(draws):
        pick = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        out.append(sum(w for _, w in pick) / sum(wo for wo, _ in pick))
    out.sort()
    return out[int(0.05 * draws)], out[int(0.95 * draws) - 1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", type=Path, required=True, help="a finished demo's home (<TIDE_HOME>/demo)")
    ap.add_argument("--drafter", default="static", help="the drafter the engine serves (a folder or 'static')")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--requests", type=int, default=36, help="requests per round")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--unconfined", action="store_true", help="the retrain on any CPU at niceness 0")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = load_config(args.home / "run" / "tide.yaml", env={})
    cpus, nice = ("", 0) if args.unconfined else (cfg.schedule.local_cpus, cfg.schedule.local_nice)
    prompts = load_prompts("code", "train", args.requests, 12)  # the demo's phase-2 draw
    scratch = Path(tempfile.mkdtemp(prefix="serve-beside-retrain-"))
    port = free_port()
    engine = python_service("engine", "tide.services.engine",
                            ["--config", str(engine_config(args.home, scratch, args.drafter)), "--port", str(port)],
                            scratch, {"TIDE_HOME": str(args.home)}, f"http://127.0.0.1:{port}/health").start()
    pairs: list[tuple[float, float]] = []
    try:
        engine.wait_healthy(600)
        url = f"http://127.0.0.1:{port}"
        one_round(url, prompts, args.concurrency, args.concurrency, args.max_tokens)  # warm-up
        for i in range(args.pairs):
            got = {}
            for side in (("without", "with") if i % 2 == 0 else ("with", "without")):
                if side == "with":
                    launcher, handle = start_retrain(args.home, scratch, cpus, nice, i)
                    try:
                        got[side] = one_round(url, prompts, args.requests, args.concurrency, args.max_tokens)
                    finally:
                        launcher.kill(handle)
                else:
                    got[side] = one_round(url, prompts, args.requests, args.concurrency, args.max_tokens)
            pairs.append((got["without"], got["with"]))
            print(f"pair {i + 1}: without {got['without']:.2f} tok/s, with a retrain {got['with']:.2f} tok/s", flush=True)
    finally:
        engine.stop()
    ratio = sum(w for _, w in pairs) / sum(wo for wo, _ in pairs)
    lo, hi = bootstrap(pairs)
    print_table(f"served tok/s beside a retrain ({'unconfined' if args.unconfined else f'cpus {cpus!r}, nice {nice}'})",
                [("pair", "without", "with")] + [(i + 1, f"{a:.2f}", f"{b:.2f}") for i, (a, b) in enumerate(pairs)]
                + [("with / without", f"{ratio:.3f}", f"({lo:.3f}-{hi:.3f})")])
    write_json(args.json, {"home": str(args.home), "cpus": cpus, "nice": nice, "pairs": pairs, "ratio": ratio,
                           "interval_90": [lo, hi], "requests": args.requests, "concurrency": args.concurrency})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
