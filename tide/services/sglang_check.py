"""The SGLang engine end to end on one GPU: ``scripts/gpu_check_sglang.sh`` (needs SGLang + CUDA).

Steps (each bounded in time; any failure exits 1 with the reason):
1. the local stack (tide/stack.py) with the SGLang engine: broker, MLflow, ``tide serve --engine
   sglang`` (SGLang server with the plugin, the packaged static drafter as first champion), ingest
   and scheduler (retrains off: this checks serving, capture and the swap);
2. phase A: ``--requests`` / 2 completions through TIDE's OpenAI route (8 at a time);
3. capture: wait until ingest's Parquet index holds records of as many requests;
4. a second drafter (the champion's weights, perturbed, same vocab mapping) registered as
   challenger and promoted through ``POST /control/promote`` *while* phase B's requests run;
5. zero failed requests across both phases, the engine serving the new version, acceptance
   (tokens per target forward, from the plugin's tide_engine_* series on SGLang's /metrics) per
   drafter version printed before/after.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from tide.metrics_text import by_label, parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tide.services.sglang_check")
    p.add_argument("--target", help="HF folder of the target (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="EAGLE3 drafter folder for it (default: the packaged static drafter)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--home", help="TIDE_HOME for the run (default: a temporary folder)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="bound on each waiting step")
    return p.parse_args(argv)


def _complete(base: str, i: int, failures: list, max_tokens: int = 64) -> None:
    body = {"model": "tide", "prompt": f"Question {i}: explain, step by step, how a {i % 7}-bit adder works.",
            "max_tokens": max_tokens, "temperature": 0, "workload": "check"}
    try:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
        if r.status_code != 200 or not r.json()["choices"][0]["text"]:
            failures.append(f"request {i}: HTTP {r.status_code} {r.text[:200]}")
    except httpx.HTTPError as exc:
        failures.append(f"request {i}: {exc}")


def _phase(base: str, start: int, n: int, failures: list) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: _complete(base, i, failures), range(start, start + n)))


def acceptance(sglang_url: str) -> dict[str, float]:
    """Tokens committed per target forward, by drafter version (the plugin's histogram)."""
    families = parse(httpx.get(f"{sglang_url}/metrics", timeout=10).text)
    sums = by_label(families, "tide_engine_accept_length_tokens_sum", "drafter_version")
    counts = by_label(families, "tide_engine_accept_length_tokens_count", "drafter_version")
    return {v: sums.get(v, 0.0) / count for v, count in counts.items() if count}


def perturbed_copy(folder: Path, out: Path, scale: float = 0.02) -> Path:
    """Another valid drafter: ``folder``'s weights with small noise, same vocab mapping."""
    from tide.drafter.artifact import load_drafter, save_drafter

    drafter = load_drafter(folder)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.is_floating_point() and p.dim() == 2:
                p.mul_(1 + scale * torch.randn(p.shape, generator=g))
    return save_drafter(drafter, out, metadata={"tide.kind": "gpu-check"})


def _wait(what: str, done, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(1.0)


def run(args: argparse.Namespace) -> int:
    from tide.config import load_config
    from tide.dataset.location import Location
    from tide.dataset.table import DatasetTable
    from tide.drafter.static import PACKAGED
    from tide.models.checkpoint import ensure_target_checkpoint
    from tide.registry import Registry
    from tide.stack import Stack, StackOptions

    home = Path(args.home or tempfile.mkdtemp(prefix="tide-sglang-check-"))
    target = args.target or str(ensure_target_checkpoint(home))
    drafter = Path(args.drafter or PACKAGED)
    half = args.requests // 2
    stack = Stack(StackOptions(home, prometheus=False, engine_module="tide.services.sglang_engine",
                               engine_args=("--target", target), engine_timeout_s=args.timeout_s,
                               overrides={"drafter": {"path": str(drafter)}, "model": {"model_id": target},
                                          "schedule": {"min_new_samples": 10**15},
                                          "ops": {"poll_interval_s": 5.0}}))
    failures: list[str] = []
    try:
        stack.start()
        cfg = load_config(stack.config_path)
        base, sglang_url = stack.endpoints["engine"], f"http://{cfg.sglang.host}:{cfg.sglang.port}"
        t0 = time.monotonic()
        _phase(base, 0, half, failures)
        print(f"phase A: {half} requests in {time.monotonic() - t0:.1f} s, {len(failures)} failed")
        index = DatasetTable(Location.from_config(cfg))
        _wait("capture records in the dataset table", lambda: index.summary()["requests"] >= half, args.timeout_s)
        print(f"capture: {json.dumps(index.summary())}")
        before = acceptance(sglang_url)

        registry = Registry.from_config(cfg)
        run_ = registry.start_run("gpu-check")
        version = registry.register(run_.log_drafter(perturbed_copy(drafter, home / "second")),
                                    {"tide.kind": "gpu-check"}).version
        run_.finish()
        load = threading.Thread(target=_phase, args=(base, half, args.requests - half, failures))
        load.start()
        time.sleep(2.0)  # phase B is in flight when the swap lands
        auth = {"Authorization": f"Bearer {cfg.server.control_token}"}
        answer = httpx.post(f"{base}/control/promote", json={"version": version, "reason": "gpu check"},
                            headers=auth, timeout=args.timeout_s)
        print(f"promote {version}: HTTP {answer.status_code} {answer.text[:300]}")
        load.join(args.timeout_s)
        serving = httpx.get(f"{base}/control/health", headers=auth, timeout=30).json()
        after = acceptance(sglang_url)
        print(f"acceptance before the swap (tokens per target forward, by version): {before}")
        print(f"acceptance after the swap: {after}")
        print(f"failed requests: {len(failures)} of {args.requests}")
        for f in failures[:10]:
            print("  ", f)
        problems = [p for p, bad in (("requests failed", failures), ("promote refused", answer.status_code != 200),
                                     ("new version not serving", str(version) not in json.dumps(serving)))
                    if bad]
        print("GPU CHECK", "PASSED" if not problems else f"FAILED: {problems}")
        return 0 if not problems else 1
    finally:
        stack.stop()
        if not args.home:
            shutil.rmtree(home, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
