"""Hot swaps under load: promote and roll back while streams run, and measure what clients see.

Steps:
1. registry: a fresh MLflow SQLite store in a work folder; version 1 = the static drafter
   (champion), version 2 = the same drafter with slightly perturbed weights (challenger);
2. reference: an engine process with speculation off (target-only) answers every prompt once;
3. load: an engine process (tide/services/engine.py, speculation on, following the registry)
   and a load generator in another process keeping ``--concurrency`` streaming greedy chat
   requests in flight; meanwhile this process promotes version 2 and rolls back to version 1
   ``--swaps`` times each over the control API;
4. report: failed or truncated requests, outputs that differ from target-only, the engine's
   swap pause per swap (time its decode loop spent applying the swap, returned by the control
   API and observed in tide_engine_swap_pause_seconds) against the median decode step
   (tide_engine_step_seconds), and the stream gaps clients saw around swaps.

    python -m bench.swap [--target smollm2|tiny] [--swaps 5] [--concurrency 8] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PROMPTS = [
    "What is the capital of France?", "Give me three tips for sleeping better.",
    "Write a haiku about autumn.", "Explain what a CPU does in two sentences.",
    "How do I reverse a list in Python?", "Name three planets and one fact about each.",
    "What is photosynthesis?", "Suggest a name for a small coffee shop.",
    "Translate 'good morning' into Spanish and French.", "Why is the sky blue?",
    "Write a Python function that adds two numbers.", "What are the primary colors?",
    "Give a one-line definition of gravity.", "List four fruits that are red.",
    "How many days are in a leap year?", "What does HTTP stand for?",
]


# --- load generator (runs in its own process) ---------------------------------------------------

def one_request(client: httpx.Client, url: str, idx: int, prompt: str, max_tokens: int) -> dict:
    rec = {"prompt": idx, "text": "", "finish_reason": None, "done": False, "status": None,
           "error": None, "t_start": time.time(), "event_times": []}
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                rec["error"] = resp.read().decode(errors="replace")[:300]
                return rec
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    rec["done"] = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    rec["error"] = obj["error"].get("message")
                    continue
                choice = obj["choices"][0]
                if choice["delta"].get("content"):
                    rec["text"] += choice["delta"]["content"]
                    rec["event_times"].append(time.time())
                rec["finish_reason"] = choice.get("finish_reason") or rec["finish_reason"]
    except httpx.HTTPError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["t_end"] = time.time()
    return rec


def run_loadgen(url: str, prompts: list[str], concurrency: int, max_tokens: int, stop_file: Path | None,
                out: Path, once: bool = False) -> None:
    """``concurrency`` workers stream requests until ``stop_file`` exists (or each prompt once)."""
    results: list[dict] = []
    order = list(range(len(prompts)))

    def worker(w: int) -> None:
        with httpx.Client(timeout=600) as client:
            i = w
            while (i < len(order)) if once else not stop_file.exists():
                idx = order[i % len(order)]
                results.append(one_request(client, url, idx, prompts[idx], max_tokens))
                i += concurrency
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    out.write_text("\n".join(json.dumps(r) for r in results))


# --- orchestration ---------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (with 10 swaps, p99 is the maximum)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else float("nan")


def histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets [(le, count)], sum, count) of an unlabelled histogram on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets, total, count = [], 0.0, 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_sum"):
                total = s.value
            elif s.name.endswith("_count"):
                count = s.value
    return sorted(buckets), total, count


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus-style: linear interpolation inside the bucket holding the q-th observation."""
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    rank, prev_le, prev_c = q * buckets[-1][1], 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / max(c - prev_c, 1e-12))
        prev_le, prev_c = le, c
    return prev_le


def prepare(args, work: Path):
    """Config file, and the registry with version 1 (static, champion) and 2 (challenger)."""
    import torch
    import yaml

    from tide.config import load_config
    from tide.contracts import CHALLENGER, TAG_KIND, TAG_PARENT
    from tide.drafter.artifact import load_drafter, save_drafter
    from tide.drafter.static import static_drafter_path
    from tide.registry import Registry

    torch.set_num_threads(1)
    overrides: dict = {
        "drafter": {}, "engine": {"max_batch_size": args.concurrency},
        "server": {"control_token": secrets.token_hex(16)},
        "registry": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}", "registered_model_name": "bench-swap",
                     "artifact_location": (work / "artifacts").as_uri(), "cache_dir": str(work / "cache")},
        "ops": {"guard_enabled": False, "bootstrap_static": False}}
    if args.target == "tiny":
        from tide.models.llama import LlamaTarget
        from tide.models.tiny import tiny_llama_checkpoint
        from tide.train.offline import new_drafter

        folder = tiny_llama_checkpoint(work / "tiny-target")
        target = LlamaTarget.from_folder(folder, aux_layer_ids=(1, 2, 3), max_seq_len=512)
        static = save_drafter(new_drafter(target, 256, torch.arange(512).flip(0), seed=1).eval(),
                              work / "tiny-static", metadata={"version": "static"})
        overrides["model"] = {"target": str(folder), "model_id": "tiny", "aux_layer_ids": [1, 2, 3],
                              "max_seq_len": 512}
    else:
        static = Path(args.drafter) if args.drafter else static_drafter_path(load_config())
    overrides["drafter"]["path"] = str(static)
    cfg_path = work / "tide.yaml"
    cfg_path.write_text(yaml.safe_dump(overrides))
    cfg = load_config(cfg_path, env={})
    registry = Registry.from_config(cfg)
    registry.ensure_bootstrap(static)
    second = load_drafter(static)
    with torch.no_grad():  # a distinct artifact that drafts about as well
        gen = torch.Generator().manual_seed(2)
        second.fc.weight.add_(1e-3 * second.fc.weight.std() * torch.randn(second.fc.weight.shape, generator=gen))
    folder = save_drafter(second, work / "v2", metadata={"version": "bench-v2", "parent_version": "1"})
    run = registry.start_run("bench-swap-v2", {TAG_KIND: "retrain"})
    version = registry.register(run.log_drafter(folder), {TAG_KIND: "retrain", TAG_PARENT: "1"},
                                alias=CHALLENGER).version
    run.finish()
    return cfg, cfg_path, version


def start_engine(name: str, cfg_path: Path, work: Path, env: dict):
    from tide.process import free_port, python_service

    port = free_port()
    proc = python_service(name, "tide.services.engine", ["--config", str(cfg_path), "--port", str(port)],
                          work / "logs", env=env, health_url=f"http://127.0.0.1:{port}/health")
    proc.start()
    try:
        proc.wait_healthy(timeout_s=600)
    except BaseException:
        proc.stop()
        raise
    return proc, f"http://127.0.0.1:{port}"


def loadgen_process(url: str, args, work: Path, tag: str, once: bool):
    import subprocess

    prompts_file, out = work / "prompts.json", work / f"{tag}.jsonl"
    prompts_file.write_text(json.dumps(PROMPTS[:args.prompts]))
    argv = [sys.executable, "-m", "bench.swap", "--loadgen", url, "--prompts-file", str(prompts_file),
            "--out", str(out), "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
            "--stop-file", str(work / f"{tag}.stop")] + (["--once"] if once else [])
    return subprocess.Popen(argv), out


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_bench(args) -> dict:
    from tide.ops.inventory import live_acceptance_from_metrics

    work = Path(args.work or tempfile.mkdtemp(prefix="tide-bench-swap-"))
    work.mkdir(parents=True, exist_ok=True)
    t_begin = time.monotonic()
    cfg, cfg_path, v2 = prepare(args, work)
    print(f"work folder {work}; registry versions 1 (champion) and {v2}", flush=True)

    # reference: target-only greedy outputs of every prompt
    proc, url = start_engine("engine-target-only", cfg_path, work,
                             {"TIDE_SPEC__ENABLED": "false", "TIDE_OPS__FOLLOW_REGISTRY": "false"})
    try:
        gen, out = loadgen_process(url, args, work, "reference", once=True)
        gen.wait()
    finally:
        proc.stop()
    reference = {r["prompt"]: r for r in read_results(out)}
    assert all(r["done"] and not r["error"] for r in reference.values()), "reference run failed"
    print(f"reference: {len(reference)} target-only outputs", flush=True)

    proc, url = start_engine("engine-swap", cfg_path, work, {})
    auth = {"Authorization": f"Bearer {cfg.server.control_token}"}
    swaps: list[dict] = []
    try:
        serving = httpx.get(f"{url}/health").json()["drafter_version"]
        assert serving == "1", f"engine serves {serving}, expected registry version 1"
        gen, out = loadgen_process(url, args, work, "load", once=False)
        time.sleep(args.warmup_s)
        with httpx.Client(timeout=300, headers=auth) as client:
            for i in range(args.swaps):
                for op, body in (("promote", {"version": v2, "actor": "bench"}), ("rollback", {"actor": "bench"})):
                    t0 = time.time()
                    resp = client.post(f"{url}/control/{op}", json=body)
                    t1 = time.time()
                    data = resp.json()
                    if resp.status_code != 200:
                        raise RuntimeError(f"{op} #{i + 1} failed: {resp.status_code} {data}")
                    swaps.append({"op": op, "t0": t0, "t1": t1, "status": data["outcome"]["status"],
                                  "to": data["to"], "pause_s": data["engine_swap_pause_s"],
                                  "applied_s": data["outcome"]["pause_s"], "request_s": t1 - t0})
                    print(f"{op:>8} -> {data['to']}: {data['outcome']['status']}, engine pause "
                          f"{data['engine_swap_pause_s'] * 1e3:.3f} ms (request {t1 - t0:.2f} s)", flush=True)
                    time.sleep(args.gap_s)
        (work / "load.stop").write_text("stop")
        gen.wait()
        metrics_text = httpx.get(f"{url}/metrics").text
        health = httpx.get(f"{url}/control/health", headers=auth).json()  # engine + ops details
    finally:
        (work / "load.stop").write_text("stop")
        proc.stop()
    return analyse(args, read_results(out), reference, swaps, metrics_text, health,
                   live_acceptance_from_metrics(metrics_text), time.monotonic() - t_begin, work)


def analyse(args, results, reference, swaps, metrics_text, health, live, wall_s, work) -> dict:
    failed = [r for r in results if r["status"] != 200 or r["error"]]
    truncated = [r for r in results if r not in failed and not (r["done"] and r["finish_reason"] in ("length", "stop"))]
    mismatched = [r for r in results if r not in failed and r["text"] != reference[r["prompt"]]["text"]]
    pauses = [s["pause_s"] for s in swaps]
    step_buckets, step_sum, step_count = histogram(metrics_text, "tide_engine_step_seconds")
    _, pause_sum, pause_count = histogram(metrics_text, "tide_engine_swap_pause_seconds")
    # gaps between a stream's events after its second one (the first gap also waits for the
    # prefills of requests admitted with it), split by whether a swap request overlapped them
    swap_gaps, other_gaps = [], []
    for r in results:
        times = r["event_times"]
        for a, b in zip(times[1:], times[2:]):
            overlaps = any(s["t0"] <= b and a <= s["t1"] for s in swaps)
            (swap_gaps if overlaps else other_gaps).append(b - a)
    step_p50 = histogram_quantile(step_buckets, 0.5)
    swapped_during = sum(1 for r in results if any(r["t_start"] < s["t1"] and s["t0"] < r["t_end"] for s in swaps))
    summary = {
        "target": args.target, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "prompts": args.prompts, "requests": len(results), "requests_spanning_a_swap": swapped_during,
        "failed": len(failed), "truncated": len(truncated), "outputs_differing_from_target_only": len(mismatched),
        "promotes": sum(s["op"] == "promote" for s in swaps), "rollbacks": sum(s["op"] == "rollback" for s in swaps),
        "swap_statuses": sorted({s["status"] for s in swaps}),
        "swap_pause_p50_s": percentile(pauses, 50), "swap_pause_p99_s": percentile(pauses, 99),
        "swap_pause_max_s": max(pauses) if pauses else None,
        "swap_pause_histogram_count": pause_count, "swap_pause_histogram_sum_s": pause_sum,
        "decode_step_p50_s": step_p50, "decode_step_mean_s": step_sum / step_count if step_count else None,
        "decode_steps": step_count,
        "stream_gap_p50_s_no_swap": percentile(other_gaps, 50), "stream_gap_p99_s_no_swap": percentile(other_gaps, 99),
        "stream_gap_p50_s_during_swap": percentile(swap_gaps, 50),
        "stream_gap_p99_s_during_swap": percentile(swap_gaps, 99),
        "stream_gaps": {"during_swap": len(swap_gaps), "no_swap": len(other_gaps)},
        "swap_request_p50_s": percentile([s["request_s"] for s in swaps], 50),
        "live_accept_length": live, "engine_health": health, "wall_s": wall_s, "work_dir": str(work),
        "swaps": swaps,
        "examples": {"failed": failed[:3], "truncated": truncated[:3], "mismatched": [
            {"prompt": r["prompt"], "got": r["text"], "want": reference[r["prompt"]]["text"]} for r in mismatched[:3]]},
    }
    summary["p99_pause_within_one_step"] = bool(summary["swap_pause_p99_s"] <= step_p50)
    return summary


def print_summary(s: dict) -> None:
    from bench.report import print_table

    ms = lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1e3:.3f} ms"  # noqa: E731
    print_table(f"hot swap under load ({s['target']}, {s['concurrency']} streams, {s['max_tokens']} tokens each)", [
        ("requests completed", s["requests"], f"({s['requests_spanning_a_swap']} in flight across a swap)"),
        ("failed / truncated", f"{s['failed']} / {s['truncated']}"),
        ("outputs != target-only greedy", s["outputs_differing_from_target_only"]),
        ("promotes / rollbacks", f"{s['promotes']} / {s['rollbacks']}", ",".join(s["swap_statuses"])),
        ("swap pause p50 / p99 / max", ms(s["swap_pause_p50_s"]), ms(s["swap_pause_p99_s"]), ms(s["swap_pause_max_s"])),
        ("decode step p50 / mean", ms(s["decode_step_p50_s"]), ms(s["decode_step_mean_s"]),
         f"({int(s['decode_steps'])} steps)"),
        ("p99 swap pause <= one decode step", "yes" if s["p99_pause_within_one_step"] else "NO"),
        ("stream gap p50 / p99, no swap", ms(s["stream_gap_p50_s_no_swap"]), ms(s["stream_gap_p99_s_no_swap"]),
         f"({s['stream_gaps']['no_swap']} gaps)"),
        ("stream gap p50 / p99, during swap", ms(s["stream_gap_p50_s_during_swap"]),
         ms(s["stream_gap_p99_s_during_swap"]),
         f"({s['stream_gaps']['during_swap']} gaps; validation competes for the CPU)"),
        ("control request p50 (validate + swap)", f"{s['swap_request_p50_s']:.2f} s"),
        ("live accept length by version", ", ".join(f"{k}: {v:.2f}" for k, v in sorted(s["live_accept_length"].items()))),
        ("wall time", f"{s['wall_s']:.0f} s"),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--drafter", help="(smollm2) static drafter folder; default: the cached/packaged one")
    parser.add_argument("--swaps", type=int, default=5, help="promote + rollback pairs")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--gap-s", type=float, default=1.5, help="wait after each swap")
    parser.add_argument("--work", help="work folder (default: a new temporary one)")
    parser.add_argument("--json", help="write the summary here")
    # load generator mode (internal: the bench starts itself in another process)
    parser.add_argument("--loadgen", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--stop-file", help=argparse.SUPPRESS)
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.loadgen:
        run_loadgen(args.loadgen, json.loads(Path(args.prompts_file).read_text()), args.concurrency,
                    args.max_tokens, Path(args.stop_file), Path(args.out), once=args.once)
        return 0
    summary = run_bench(args)
    print_summary(summary)
    from bench.report import write_json
    write_json(args.json, summary)
    ok = (summary["failed"] == summary["truncated"] == summary["outputs_differing_from_target_only"] == 0
          and summary["swap_statuses"] == ["swapped"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
