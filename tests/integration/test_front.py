"""The local front (tide/services/front.py) over two real engine processes of the tiny target, as
``tide up --engines 2`` runs them: under steady traffic one replica is killed (SIGKILL), brought
back, then the other hangs (SIGSTOP). Requests not started on the replica that went away are
retried on the other and counted; a stream already started ends with an error event at once
(counted); every other answer is the target's own greedy output; no request waits to its deadline
(the client's timeout), and a replica that comes back is used again."""
from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from tide.process import ServiceProcess, free_port, python_service

PROMPTS = ["The quick brown fox", "def fibonacci(n: int)", "Please write a short story", "class Stack:",
           "How do I make a cup of tea?", "import os\nfor name in", "Tell me a joke.", "What is the capital of"]
MAX_TOKENS = 48
DEADLINE_S = 120.0  # the clients' timeout: a request still waiting then has hung


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory) -> Path:
    from tide.drafter.artifact import save_drafter
    from tide.models.llama import LlamaTarget
    from tide.models.tiny import tiny_llama_checkpoint
    from tide.train.offline import new_drafter

    root = tmp_path_factory.mktemp("front")
    folder = tiny_llama_checkpoint(root / "target")
    target = LlamaTarget.from_folder(folder, aux_layer_ids=(1, 2, 3), max_seq_len=256)
    drafter = save_drafter(new_drafter(target, 256, torch.arange(512).flip(0), seed=1).eval(), root / "drafter",
                           metadata={"version": "static"})
    cfg = {"home": str(root / "home"), "capture": {"enabled": False}, "ops": {"follow_registry": False},
           "model": {"target": str(folder), "model_id": "tiny", "aux_layer_ids": [1, 2, 3], "max_seq_len": 256,
                     "torch_threads": 1},
           "drafter": {"path": str(drafter)}, "engine": {"max_batch_size": 4, "max_new_tokens_limit": 64}}
    path = root / "tide.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_engine(config: Path, port: int, logs: Path) -> ServiceProcess:
    return python_service(f"engine-{port}", "tide.services.engine", ["--config", str(config), "--port", str(port)],
                          logs, health_url=f"http://127.0.0.1:{port}/health").start()


def ask(url: str, i: int, stream: bool) -> dict:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    rec = {"prompt": i % len(PROMPTS), "stream": stream, "status": None, "text": "", "done": False, "error": None}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=DEADLINE_S) as resp:
            rec["status"] = resp.status_code
            if not stream or resp.status_code != 200:
                resp.read()
                rec["text"] = resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text
                rec["done"] = resp.status_code == 200
                return rec
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    rec["done"] = True
                elif line.startswith("data: "):
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        rec["error"] = obj["error"]["message"]
                    else:
                        rec["text"] += obj["choices"][0]["text"]
    except httpx.HTTPError as exc:  # a timeout here is a request that hung to its deadline
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


def traffic(url: str, n: int, trigger) -> list[dict]:
    """``n`` requests from 6 clients, half of them streams; ``trigger()`` runs beside them."""
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, url, i, i % 2 == 0) for i in range(n)]
        side = threading.Thread(target=trigger)
        side.start()
        out = [f.result() for f in futures]
        side.join(60)
    return out


def inflight(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).json().get("inflight_requests", 0)
    except httpx.HTTPError:
        return 0


def check(results: list[dict], solo: dict[int, str]) -> int:
    """Every answer is the solo greedy output, or a started stream cut with an error; returns the cuts."""
    cut = 0
    for r in results:
        assert r["status"] == 200 and not (r["error"] or "").startswith(("ReadTimeout", "ConnectError")), r
        if r["stream"] and r["error"]:
            assert "went away" in r["error"] and not r["done"], r
            cut += 1
        else:
            assert r["done"] and r["text"] == solo[r["prompt"]], r
    return cut


def test_a_replica_going_away_is_retried_elsewhere_and_nothing_hangs(engine_config, tmp_path, wait):
    logs = tmp_path / "logs"
    ports = [free_port(), free_port()]
    engines = [start_engine(engine_config, p, logs) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    front_port = free_port()
    front = python_service("front", "tide.services.front", [a for u in urls for a in ("--backend", u)] + [
        "--port", str(front_port), "--probe-s", "0.5"], logs, health_url=f"http://127.0.0.1:{front_port}/health")
    try:
        for e in engines:
            e.wait_healthy(300)
        front.start().wait_healthy(60)
        url = f"http://127.0.0.1:{front_port}"
        solo = {i: ask(urls[1], i, False)["text"] for i in range(len(PROMPTS))}
        counts = lambda: httpx.get(f"{url}/health", timeout=5).json()["counts"]  # noqa: E731

        def kill_first() -> None:
            wait(lambda: inflight(urls[0]) >= 2, 60, 0.02, what="requests in flight on the first replica")
            os.killpg(engines[0].proc.pid, signal.SIGKILL)

        cut = check(traffic(url, 48, kill_first), solo)
        after_kill = counts()
        retried = sum(v for k, v in after_kill.items() if k.startswith("retried:"))
        assert retried >= 1 and after_kill.get("cut", 0) == cut and after_kill.get("no_backend", 0) == 0, after_kill
        assert not [b for b in httpx.get(f"{url}/health", timeout=5).json()["backends"] if b["url"] == urls[0]][0]["up"]

        engines[0] = start_engine(engine_config, ports[0], logs)  # it comes back: the front uses it again
        engines[0].wait_healthy(300)
        wait(lambda: all(b["up"] for b in httpx.get(f"{url}/health", timeout=5).json()["backends"]), 30,
             what="the front to see the replica back")

        def hang_second() -> None:
            wait(lambda: inflight(urls[1]) >= 2, 60, 0.02, what="requests in flight on the second replica")
            os.killpg(engines[1].proc.pid, signal.SIGSTOP)

        try:
            results = traffic(url, 48, hang_second)
        finally:
            os.killpg(engines[1].proc.pid, signal.SIGCONT)
        cut2 = check(results, solo)
        after_hang = counts()
        assert after_hang.get("retried:backend_down", 0) >= 1, after_hang
        assert after_hang.get("cut", 0) == cut + cut2 and after_hang.get("no_backend", 0) == 0, after_hang
        assert inflight(urls[0]) == 0 and httpx.get(f"{urls[0]}/health", timeout=5).json()["requests_finished"] > 0
    finally:
        front.stop()
        for e in engines:
            e.stop()
