"""Serving under load and slow clients: streaming clients plus connections that send headers slowly.

Steps:
1. an engine process (tide/services/engine.py, speculation on; the SmolLM2 target, or
   ``--target tiny``) with the bench's limits: ``--max-connections`` (below streams + slow, so
   there is an excess), ``--max-inflight``; head/body deadlines at ServerConfig's defaults;
2. solo: each prompt once, one request at a time: its greedy output, the reference;
3. idle probes: this process GETs /health (a new connection each time, as a kubelet does) every
   ``--probe-s`` and /metrics every 5th time, for ``--idle-s``;
4. load, ``--duration-s``: a load process runs ``--streams`` clients that stream greedy chat
   requests back to back over the prompts (a 503 waits its Retry-After), and, from
   ``--slow-start-s`` on (the streams' connections are open by then), ``--slow`` connections that
   send a request head one byte per ``--slow-byte-s`` until the server answers or closes, then
   reconnect after Retry-After (or 1 s) with +-50% jitter, as retrying clients do; the same probes
   run meanwhile. New requests stop at the end; those in flight finish;
5. report: every answer by kind and status, 5xx other than 503, 503s without Retry-After, accepted
   outputs that differ from solo, truncated streams; /health and /metrics latency p50 / p99 idle
   vs under load, with 90% bootstrap intervals of the p99s and of their ratio.
With ``--engines N`` (N > 1) step 1 starts N engine processes behind the local front
(tide/services/front.py, as ``tide up --engines N`` runs them): the solo outputs, the streams and the
probes go through the front, and the report adds its counters (retries, cut streams, no backend);
the slow-header connections go to the first engine itself, whose connection limits they test (the
front is a local convenience without them; in Kubernetes the Service fronts the replicas).

    python -m bench.load [--target smollm2|tiny] [--engines 1] [--streams 64] [--slow 200] [--duration-s 60] [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from bench.swap import PROMPTS, percentile

SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: bench\r\nUser-Agent: slow-headers\r\nX-Pad: " + b"a" * 4096


# --- the load process: streaming clients and slow-header connections ------------------------------

async def one_request(client: httpx.AsyncClient, url: str, idx: int, max_tokens: int) -> dict:
    rec = {"kind": "stream", "prompt": idx, "status": None, "text": "", "done": False, "finish": None,
           "error": None, "retry_after": None, "t": time.time()}
    body = {"messages": [{"role": "user", "content": PROMPTS[idx]}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            rec["status"], rec["retry_after"] = resp.status_code, resp.headers.get("retry-after")
            if resp.status_code == 200:
                await read_sse(resp, rec)
            else:
                rec["error"] = (await resp.aread()).decode(errors="replace")[:200]
    except httpx.HTTPError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


async def stream_client(client: httpx.AsyncClient, url: str, w: int, args, stop_at: float, out: list) -> None:
    """Requests back to back over the prompts (client w starts at prompt w) until ``stop_at``."""
    i = w
    while time.monotonic() < stop_at:
        rec = await one_request(client, url, i % args.prompts, args.max_tokens)
        i += args.streams
        out.append(rec)
        if rec["status"] == 503:
            await asyncio.sleep(float(rec["retry_after"] or 1))


async def read_sse(resp: httpx.Response, rec: dict) -> None:
    async for line in resp.aiter_lines():
        if line == "data: [DONE]":
            rec["done"] = True
            return
        if line.startswith("data: "):
            obj = json.loads(line[6:])
            if "error" in obj:
                rec["error"] = obj["error"].get("message")
                continue
            choice = obj["choices"][0]
            rec["text"] += choice["delta"].get("content") or ""
            rec["finish"] = choice.get("finish_reason") or rec["finish"]


async def one_slow_connection(host: str, port: int, args, stop_at: float) -> dict:
    """Send SLOW_HEAD a byte per ``slow_byte_s`` until the server answers or closes, or the load ends."""
    t0 = time.monotonic()
    rec = {"kind": "slow", "status": None, "retry_after": None, "held_s": None, "error": None, "t": time.time()}
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        rec["error"] = f"connect: {exc}"
        return rec
    answer = asyncio.ensure_future(reader.read(65536))
    try:
        for byte in SLOW_HEAD:
            if answer.done() or time.monotonic() >= stop_at:
                break
            writer.write(bytes([byte]))
            await asyncio.wait({answer}, timeout=args.slow_byte_s)
        data = answer.result() if answer.done() else b""
        rec["error"] = None if answer.done() else "still open when the load ended"
    except OSError as exc:
        data, rec["error"] = b"", type(exc).__name__
    finally:
        answer.cancel()
        writer.close()
    rec["held_s"] = time.monotonic() - t0
    head = data.split(b"\r\n\r\n")[0].decode("latin-1").lower().split("\r\n")
    if head[0].startswith("http/1.1 "):
        rec["status"] = int(head[0].split()[1])
        rec["retry_after"] = next((h.split(":", 1)[1].strip() for h in head[1:] if h.startswith("retry-after:")),
                                  None)
    return rec


async def slow_client(host: str, port: int, args, stop_at: float, out: list) -> None:
    await asyncio.sleep(args.slow_start_s)
    while time.monotonic() < stop_at:
        rec = await one_slow_connection(host, port, args, stop_at)
        out.append(rec)
        await asyncio.sleep(float(rec["retry_after"] or 1) * random.uniform(0.5, 1.5))


async def run_load(url: str, args, out_path: Path) -> None:
    host, port = (args.slow_url or url).removeprefix("http://").split(":")
    stop_at = time.monotonic() + args.duration_s
    out: list[dict] = []
    limits = httpx.Limits(max_connections=args.streams, max_keepalive_connections=args.streams)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        streams = [stream_client(client, url, w, args, stop_at, out) for w in range(args.streams)]
        slow = [slow_client(host, int(port), args, stop_at, out) for _ in range(args.slow)]
        await asyncio.gather(*streams, *slow)
    out_path.write_text("\n".join(json.dumps(r) for r in out))


# --- probes and orchestration ------------------------------------------------------------------------

class Prober:
    """GET /health every ``every_s`` (and /metrics every 5th time), one new connection each."""

    def __init__(self, url: str, every_s: float, metrics_url: str | None = None) -> None:
        self.url, self.every_s = url, every_s
        self.metrics_url = metrics_url or url  # a front has no /metrics: an engine's
        self.samples: dict[str, list[tuple[float, int]]] = {"/health": [], "/metrics": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while not self._stop.wait(self.every_s):
                for path in ("/health", "/metrics") if n % 5 == 0 else ("/health",):
                    t0 = time.perf_counter()
                    try:
                        status = client.get((self.metrics_url if path == "/metrics" else self.url) + path).status_code
                    except httpx.HTTPError:
                        status = 0
                    self.samples[path].append((time.perf_counter() - t0, status))
                n += 1

    def run_for(self, seconds: float) -> dict:
        self.start()
        time.sleep(seconds)
        return self.stop()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.samples


def p99_interval(idle: list[float], load: list[float], rounds: int = 2000, seed: int = 0) -> dict:
    """90% bootstrap intervals of each p99 and of their ratio (load / idle)."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(idle), np.asarray(load)
    pa = np.array([np.percentile(rng.choice(a, a.size), 99) for _ in range(rounds)])
    pb = np.array([np.percentile(rng.choice(b, b.size), 99) for _ in range(rounds)])
    q = lambda v: [float(np.percentile(v, 5)), float(np.percentile(v, 95))]  # noqa: E731
    return {"idle_p99_s": float(np.percentile(a, 99)), "idle_p99_interval_s": q(pa),
            "load_p99_s": float(np.percentile(b, 99)), "load_p99_interval_s": q(pb),
            "ratio": float(np.percentile(b, 99) / np.percentile(a, 99)), "ratio_interval": q(pb / pa)}


def engine_config(args, work: Path) -> Path:
    import yaml

    overrides: dict = {"engine": {"max_batch_size": args.batch_size, "max_new_tokens_limit": 256},
                       "server": {"max_connections": args.max_connections, "max_inflight_requests": args.max_inflight},
                       "ops": {"follow_registry": False}, "capture": {"enabled": False}}
    if args.target == "tiny":
        import torch

        from tide.drafter.artifact import save_drafter
        from tide.models.llama import LlamaTarget
        from tide.models.tiny import tiny_llama_checkpoint
        from tide.train.offline import new_drafter

        folder = tiny_llama_checkpoint(work / "tiny-target")
        target = LlamaTarget.from_folder(folder, aux_layer_ids=(1, 2, 3), max_seq_len=512)
        drafter = save_drafter(new_drafter(target, 256, torch.arange(512).flip(0), seed=1).eval(),
                               work / "tiny-drafter", metadata={"version": "static"})
        overrides["model"] = {"target": str(folder), "model_id": "tiny", "aux_layer_ids": [1, 2, 3], "max_seq_len": 512}
        overrides["drafter"] = {"path": str(drafter)}
    path = work / "tide.yaml"
    path.write_text(yaml.safe_dump(overrides))
    return path


def solo_outputs(url: str, args) -> dict[int, str]:
    async def one_by_one() -> list[dict]:
        async with httpx.AsyncClient(timeout=600) as client:
            return [await one_request(client, url, idx, args.max_tokens) for idx in range(args.prompts)]

    out = asyncio.run(one_by_one())
    bad = [r for r in out if not (r["status"] == 200 and r["done"] and not r["error"])]
    assert not bad, f"solo requests failed: {bad[:2]}"
    return {r["prompt"]: r["text"] for r in out}


def start_engines(args, work: Path) -> tuple[str, list[str], list]:
    """The engines (and with several, the front before them): (url, engine urls, processes)."""
    from tide.process import free_port, python_service

    config = engine_config(args, work)
    ports = [free_port() for _ in range(args.engines)]
    procs = [python_service(f"engine-load-{i}", "tide.services.engine", ["--config", str(config), "--port", str(p)],
                            work / "logs", health_url=f"http://127.0.0.1:{p}/health").start()
             for i, p in enumerate(ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    for proc in procs:
        proc.wait_healthy(timeout_s=600)
    if args.engines == 1:
        return urls[0], urls, procs
    front = free_port()
    proc = python_service("front-load", "tide.services.front", [a for u in urls for a in ("--backend", u)] + [
        "--port", str(front)], work / "logs", health_url=f"http://127.0.0.1:{front}/health").start()
    procs.append(proc)
    proc.wait_healthy(timeout_s=60)
    return f"http://127.0.0.1:{front}", urls, procs


def run_bench(args) -> dict:
    import subprocess

    work = Path(args.work or tempfile.mkdtemp(prefix="tide-bench-load-"))
    work.mkdir(parents=True, exist_ok=True)
    t_begin = time.monotonic()
    procs: list = []
    try:
        url, engine_urls, procs = start_engines(args, work)
        solo = solo_outputs(url, args)
        print(f"solo: {len(solo)} greedy outputs, one request at a time", flush=True)
        idle = Prober(url, args.probe_s, metrics_url=engine_urls[0]).run_for(args.idle_s)
        print(f"idle probes: {len(idle['/health'])} /health", flush=True)
        out = work / "load.jsonl"
        loadgen = [sys.executable, "-m", "bench.load", "--loadgen", url, "--out", str(out),
                   f"--slow-url={engine_urls[0]}"] + [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in LOADGEN_ARGS]
        prober = Prober(url, args.probe_s, metrics_url=engine_urls[0])
        prober.start()
        subprocess.run(loadgen, check=True, timeout=args.duration_s + 1200)
        load = prober.stop()
        metrics_texts = [httpx.get(u + "/metrics").text for u in engine_urls]
        front = httpx.get(url + "/health").json().get("counts") if args.engines > 1 else None
    finally:
        for proc in reversed(procs):
            proc.stop()
    results = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    summary = analyse(args, results, solo, idle, load, metrics_texts, time.monotonic() - t_begin, work)
    summary.update(engines=args.engines, front_counts=front)
    # the front retries what had not started; a stream it had to cut, or no engine up, fails the run
    summary["ok"] = summary["ok"] and not (front or {}).get("cut") and not (front or {}).get("no_backend")
    return summary


def refused_by_reason(metrics_texts: list[str]) -> dict[str, float]:
    """The engines' connection refusals by reason, summed over the engines."""
    from collections import Counter

    from prometheus_client.parser import text_string_to_metric_families

    out: Counter[str] = Counter()
    for text in metrics_texts:
        for fam in text_string_to_metric_families(text):
            if fam.name == "tide_engine_http_connections_refused":
                out.update({s.labels["reason"]: s.value for s in fam.samples if s.name.endswith("_total")})
    return dict(out)


def analyse(args, results: list[dict], solo: dict, idle: dict, load: dict, metrics_texts: list[str], wall_s: float,
            work: Path) -> dict:
    from collections import Counter

    streams = [r for r in results if r["kind"] == "stream"]
    slow = [r for r in results if r["kind"] == "slow"]
    accepted = [r for r in streams if r["status"] == 200]
    probes = {f"{phase} {path}": samples for phase, d in (("idle", idle), ("load", load)) for path, samples in d.items()}
    latency = {path: p99_interval([t for t, _ in idle[path]], [t for t, _ in load[path]]) for path in idle}
    answered_slow = [r for r in slow if r["status"] is not None]
    summary = {
        "target": args.target, "streams": args.streams, "slow": args.slow, "duration_s": args.duration_s,
        "max_connections": args.max_connections, "max_inflight": args.max_inflight, "max_tokens": args.max_tokens,
        "stream_statuses": dict(Counter(str(r["status"]) for r in streams)),
        "slow_statuses": dict(Counter(str(r["status"]) for r in slow)),
        "slow_errors": dict(Counter(r["error"] for r in slow if r["error"])),
        "slow_held_max_s": max((r["held_s"] for r in answered_slow), default=None),
        "accepted": len(accepted),
        "truncated": sum(1 for r in accepted if not r["done"] or r["error"]),
        "differing_from_solo": sum(1 for r in accepted if r["done"] and not r["error"] and r["text"] != solo[r["prompt"]]),
        "other_5xx": sum(1 for r in streams + slow if (r["status"] or 0) >= 500 and r["status"] != 503),
        "stream_errors": sum(1 for r in streams if r["status"] is None),
        "503_without_retry_after": sum(1 for r in streams + slow if r["status"] == 503 and not r["retry_after"]),
        "probe_statuses": {k: dict(Counter(str(s) for _, s in v)) for k, v in probes.items()},
        "probe_p50_s": {k: percentile([t for t, _ in v], 50) for k, v in probes.items()},
        "latency": latency, "refused_by_reason": refused_by_reason(metrics_texts),
        "wall_s": wall_s, "work_dir": str(work),
    }
    summary["ok"] = bool(summary["other_5xx"] == summary["503_without_retry_after"] == summary["truncated"]
                         == summary["differing_from_solo"] == summary["stream_errors"] == 0
                         and latency["/health"]["load_p99_s"] < 0.1
                         and all(set(v) == {"200"} for v in summary["probe_statuses"].values()))
    return summary


def print_summary(s: dict) -> None:
    from bench.report import print_table

    ms = lambda v: f"{v * 1e3:.1f} ms"  # noqa: E731
    iv = lambda pair: f"[{pair[0] * 1e3:.1f}, {pair[1] * 1e3:.1f}]"  # noqa: E731
    rows = [
        ("streaming requests by status", json.dumps(s["stream_statuses"]), f"({s['accepted']} accepted)"),
        ("slow-header connections by answer", json.dumps(s["slow_statuses"]),
         f"longest held until answered {s['slow_held_max_s'] or 0:.1f} s"),
        ("slow connections unanswered", json.dumps(s["slow_errors"])),
        ("5xx other than 503 / 503 without Retry-After", f"{s['other_5xx']} / {s['503_without_retry_after']}"),
        ("accepted: truncated / differing from solo greedy", f"{s['truncated']} / {s['differing_from_solo']}"),
        ("stream transport errors", s["stream_errors"]),
        ("server's refusals by reason (metric)", json.dumps(s["refused_by_reason"])),
    ]
    for path, lat in s["latency"].items():
        rows.append((f"{path} p50 idle / load", ms(s["probe_p50_s"][f"idle {path}"]), ms(s["probe_p50_s"][f"load {path}"])))
        rows.append((f"{path} p99 idle / load (90% interval)", f"{ms(lat['idle_p99_s'])} {iv(lat['idle_p99_interval_s'])}",
                     f"{ms(lat['load_p99_s'])} {iv(lat['load_p99_interval_s'])}",
                     f"ratio {lat['ratio']:.2f} [{lat['ratio_interval'][0]:.2f}, {lat['ratio_interval'][1]:.2f}]"))
    rows.append(("probe statuses", json.dumps(s["probe_statuses"])))
    if s.get("front_counts") is not None:
        rows.append((f"front over {s['engines']} engines: counts", json.dumps(s["front_counts"])))
    rows.append(("all checks", "pass" if s["ok"] else "FAIL", f"(wall {s['wall_s']:.0f} s)"))
    engines = f"{s['engines']} engines behind the front, " if s.get("engines", 1) > 1 else ""
    print_table(f"serving under load ({engines}{s['target']}: {s['streams']} streams x {s['max_tokens']} tokens + {s['slow']} "
                f"slow-header connections for {s['duration_s']:g} s; max_connections {s['max_connections']}, "
                f"max_inflight {s['max_inflight']})", rows)


LOADGEN_ARGS = ("streams", "slow", "duration_s", "slow_byte_s", "slow_start_s", "prompts", "max_tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--engines", type=int, default=1, help="engine processes; more than 1 behind the local front")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--slow", type=int, default=200, help="connections sending headers slowly")
    parser.add_argument("--slow-byte-s", type=float, default=0.5, help="a slow connection sends a byte per this")
    parser.add_argument("--slow-start-s", type=float, default=2.0, help="slow connections start this after the streams")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--max-connections", type=int, default=128)
    parser.add_argument("--max-inflight", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="engine.max_batch_size")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--probe-s", type=float, default=0.1, help="a /health probe every this")
    parser.add_argument("--idle-s", type=float, default=15.0, help="probes before the load, for comparison")
    parser.add_argument("--work", help="work folder (default: a new temporary one)")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--loadgen", metavar="URL", help=argparse.SUPPRESS)  # internal: the load process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--slow-url", help=argparse.SUPPRESS)  # internal: where slow connections go
    args = parser.parse_args(argv)
    if args.loadgen:
        asyncio.run(run_load(args.loadgen, args, Path(args.out)))
        return 0
    summary = run_bench(args)
    print_summary(summary)
    from bench.report import write_json
    write_json(args.json, summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
