"""``tide demo``: the main job.

Stage now: start the engine service (real target, static drafter, speculative decoding on) as a
separate process, wait until healthy, send a sample chat request over HTTP, print the answer
with the drafter's acceptance, and stop the service.
"""
from __future__ import annotations

import time
from pathlib import Path

import httpx

from tide.process import free_port, python_service

SAMPLE = "Explain in three sentences why the sky is blue."


def acceptance_from_metrics(text: str) -> dict[str, float]:
    """tokens per target forward by drafter version, from the engine's /metrics page."""
    sums, counts = {}, {}
    for line in text.splitlines():
        if line.startswith("tide_engine_accept_length_tokens_sum{"):
            version = line.split('drafter_version="')[1].split('"')[0]
            sums[version] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("tide_engine_accept_length_tokens_count{"):
            version = line.split('drafter_version="')[1].split('"')[0]
            counts[version] = float(line.rsplit(" ", 1)[1])
    return {v: sums[v] / counts[v] for v in sums if counts.get(v)}


def run_sample(home: Path, prompt: str = SAMPLE, max_tokens: int = 96) -> dict:
    port = free_port()
    engine = python_service("engine", "services/engine/main.py", ["--port", str(port)], home / "logs",
                            env={"TIDE_HOME": str(home)}, health_url=f"http://127.0.0.1:{port}/health")
    print(f"starting engine on http://127.0.0.1:{port} (log: {engine.log_path}) ...", flush=True)
    engine.start()
    try:
        engine.wait_healthy(timeout_s=600)
        t0 = time.monotonic()
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
            "model": "tide", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0})
        resp.raise_for_status()
        body = resp.json()
        wall = time.monotonic() - t0
        acceptance = acceptance_from_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
    finally:
        engine.stop()
    answer = body["choices"][0]["message"]["content"]
    print(f"\nuser: {prompt}\nassistant: {answer}\n")
    for version, tpf in acceptance.items():
        print(f"drafter {version}: {tpf:.2f} tokens per target forward "
              f"({body['usage']['completion_tokens']} tokens in {wall:.1f}s)")
    return {"answer": answer, "acceptance": acceptance, "health": health, "usage": body["usage"]}
