"""The drafter service as its own process (``python -m tide.services.drafter``) stopped (SIGSTOP) or
killed mid-stream: no request fails, the engine goes on target-only (counted), outputs stay the
target's, and speculation resumes once the service answers again (continued, or restarted)."""
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from harness import prompts, remote_engine

import tide
from tide.drafter.artifact import save_drafter
from tide.drafting.transport import wait_until
from tide.engine.base import GenerationRequest, SamplingParams
from tide.models.tiny import tiny_llama_checkpoint
from tide.spec.generate import generate

START_TIMEOUT_S = 180.0  # python, torch and the package's imports on a loaded machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _service(config: Path) -> subprocess.Popen:
    root = str(Path(tide.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "tide.services.drafter", "--config", str(config),
                             "--log-level", "WARNING"], env=env)


class Traffic:
    """Requests one after another on two threads until stopped; every output and failure kept."""

    def __init__(self, engine, ps: list[list[int]], n: int) -> None:
        self.engine, self.ps, self.n = engine, ps, n
        self.outputs: list[tuple[int, list[int]]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(2)]
        [t.start() for t in self._threads]

    def _run(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            p = i % len(self.ps)
            req = GenerationRequest(f"t{k}-{i}", tuple(self.ps[p]), SamplingParams(max_new_tokens=self.n))
            tokens = []
            for ev in self.engine.submit(req):
                tokens += ev.token_ids
                if ev.finished and ev.finish_reason not in ("stop", "length"):
                    self.failures.append(f"{req.request_id}: {ev.finish_reason} {ev.error}")
            self.outputs.append((p, tokens))
            i += 2

    def stop(self) -> None:
        self._stop.set()
        [t.join(timeout=120) for t in self._threads]


@pytest.mark.parametrize("outage,kind", [("sigstop", "tcp"), ("kill", "ipc")])
def test_an_outage_mid_stream_fails_no_request_and_speculation_resumes(tiny_target, agreeing_drafter, tmp_path,
                                                                       outage, kind):
    folder = tiny_llama_checkpoint(tmp_path / "target")  # the fixture's weights (seeded), for the service
    drafter_dir = save_drafter(agreeing_drafter[0], tmp_path / "drafter", metadata={"version": "v1"})
    port, sock = _free_port(), tmp_path / "drafter.sock"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "home": str(tmp_path / "home"), "model": {"target": str(folder), "aux_layer_ids": [1, 2, 3], "max_seq_len": 256},
        "drafter": {"path": str(drafter_dir)}, "ops": {"follow_registry": False},
        "drafter_service": {"port": port, "ipc_path": str(sock), "metrics_port": 0}}))
    url = f"tcp://127.0.0.1:{port}" if kind == "tcp" else f"ipc://{sock}"
    proc = _service(config)
    engine = remote_engine(tiny_target, url, deadline_s=0.3, retry_s=0.1)
    view = lambda: engine.health()["drafter_service"]  # noqa: E731
    traffic = None
    try:
        assert wait_until(lambda: view()["up"] or proc.poll() is not None, START_TIMEOUT_S) and proc.poll() is None
        ps = agreeing_drafter[1] + prompts(tiny_target.shape.vocab_size, 2, seed=4)
        traffic = Traffic(engine, ps, 64)
        assert wait_until(lambda: view()["drafted_steps"] > 10, 120)
        if outage == "sigstop":
            os.kill(proc.pid, signal.SIGSTOP)
        else:
            proc.kill()
            proc.wait(timeout=30)
        fallback = lambda: sum(view()["fallback_steps"].values())  # noqa: E731
        before, tokens = fallback(), engine.stats().tokens_generated
        # the engine goes on without the service: target-only steps, counted, tokens still flowing
        assert wait_until(lambda: fallback() > before + 20 and engine.stats().tokens_generated > tokens + 100, 120)
        assert not view()["up"]
        if outage == "sigstop":
            os.kill(proc.pid, signal.SIGCONT)
        else:
            proc = _service(config)  # a new process: the engine greets it again (new sessions)
        drafted = view()["drafted_steps"]
        assert wait_until(lambda: view()["drafted_steps"] > drafted + 10, START_TIMEOUT_S)
    finally:
        if traffic is not None:
            traffic.stop()
        engine.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            proc.wait(timeout=30)
    assert traffic.failures == []
    assert traffic.outputs  # (requests in flight across the outage finished too, tokens kept flowing)
    want = [generate(tiny_target, None, p, 64)[0] for p in ps]
    assert [out for _, out in traffic.outputs] == [want[p] for p, _ in traffic.outputs]
    reasons = set(view()["fallback_steps"])
    assert reasons & {"deadline", "send_failed", "down"}, reasons
