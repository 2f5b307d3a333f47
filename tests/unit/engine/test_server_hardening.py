"""The engine's HTTP front end against what real clients and hostile ones send.

A real uvicorn server on loopback with FakeEngine behind it (tests/unit/engine/fake_engine.py);
hostile bodies go through raw sockets, because HTTP clients will not send a chunked body they are
not allowed to finish.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
from fake_engine import TOKEN, FakeEngine

from tide.config import EngineConfig, ServerConfig
from tide.engine.generation import TOKENIZE_THREADS
from tide.engine.server import HttpServer, build_app
from tide.ops.control_api import control_plane
from tide.ops.follower import OpsError

ENGINE_CFG = EngineConfig(max_batch_size=8, max_new_tokens_limit=100, max_prompt_tokens=128,
                          default_max_new_tokens=16)
CAP_BYTES = 65_536
SECRET_PATH = "/srv/secret/mlflow.db"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class FakeOps:
    """A stand-in for tide.ops.follower.DrafterFollower behind the control routes: its health names a
    path (which only token holders may see); promote fails like an unreachable registry (503)."""

    def health(self) -> dict[str, Any]:
        return {"tracking_uri": f"sqlite://{SECRET_PATH}", "last_error": "OperationalError: disk I/O"}

    def promote(self, version: int, actor: str, reason: str) -> dict[str, Any]:
        raise OpsError(503, "registry unreachable: MLflow call failed")


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def url(fake: FakeEngine) -> Iterator[str]:
    cfg = ServerConfig(host="127.0.0.1", port=0, control_token=TOKEN, max_body_bytes=CAP_BYTES)
    server = HttpServer(build_app(fake, cfg, ENGINE_CFG, ops=control_plane(FakeOps())), "127.0.0.1", 0, grace_s=1,
                        log_level="warning")
    port = server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def sent(fake: FakeEngine, rid: str):
    return next(q for q in fake.requests if q.request_id == rid)


# --- part 1: what OpenAI clients and load tools send ------------------------------------------------

ACCEPTED = [
    ({"max_completion_tokens": 7}, lambda s: s.max_new_tokens == 7),
    ({"max_tokens": 9, "max_completion_tokens": 9}, lambda s: s.max_new_tokens == 9),
    ({"frequency_penalty": 0, "presence_penalty": 0.0}, None),
    ({"user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto"}, None),
    ({"logprobs": False, "top_logprobs": 0, "logit_bias": {}, "tools": [], "tool_choice": "none",
      "parallel_tool_calls": True, "response_format": {"type": "text"}, "n": 1}, None),
    ({"seed": 3, "temperature": 0.7, "top_k": 40}, lambda s: (s.seed, s.temperature, s.top_k) == (3, 0.7, 40)),
    ({"top_k": -1}, lambda s: s.top_k == 0),
    ({"ignore_eos": True, "min_tokens": 5, "max_tokens": 5},
     lambda s: s.ignore_eos and 258 not in s.stop_token_ids),
    ({"stop": [65, 66]}, lambda s: s.stop_token_ids[:2] == (65, 66)),
    ({"stop_token_ids": [70]}, lambda s: 70 in s.stop_token_ids),
    ({"temperature": 1e-40}, lambda s: s.temperature == 0.0),  # greedy, as vLLM/SGLang do
    ({"temperature": 0.5e-5}, lambda s: s.temperature == 0.0),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra,check", ACCEPTED, ids=[str(list(e)) for e, _ in ACCEPTED])
def test_openai_fields_are_accepted_and_reach_the_engine(url: str, fake: FakeEngine, path: str,
                                                          extra: dict, check: Any) -> None:
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(url + path, json={**base, **extra})
    assert r.status_code == 200, r.text
    sampling = sent(fake, r.json()["id"]).sampling
    assert check is None or check(sampling), sampling


def test_eos_id_is_the_tokenizers(fake: FakeEngine) -> None:
    assert fake.tokenizer.eos_token_id == 258  # ACCEPTED's ignore_eos check relies on it


def test_token_id_prompts(url: str, fake: FakeEngine) -> None:
    for prompt in ([72, 105], [[72, 105]]):
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert sent(fake, r.json()["id"]).prompt_ids == (72, 105)
        assert r.json()["usage"]["prompt_tokens"] == 2
    r = httpx.post(url + "/v1/completions", json={"prompt": ["only one"], "max_tokens": 4})
    assert r.status_code == 200 and sent(fake, r.json()["id"]).prompt_ids == tuple(fake.tokenizer.encode("only one"))


def test_developer_role_is_a_system_message(url: str, fake: FakeEngine) -> None:
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "developer", "content": "be brief"},
                                                                   {"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert "<|im_start|>system\nbe brief" in fake.tokenizer.decode(list(sent(fake, r.json()["id"]).prompt_ids))


REFUSED = [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logit_bias": {"50": 10}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"min_tokens": 4}, "min_tokens"),  # needs eos masked in verification: only with ignore_eos
    ({"min_tokens": 4, "ignore_eos": True, "stop": ["x"]}, "min_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 101}, "max_completion_tokens"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"stop": [100_000]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop"),
    ({"stop": ["a", 5]}, "stop"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True}, "echo"),
    ({"no_such_field": 1}, "no_such_field"),  # unknown fields: still a 400 naming them
]


@pytest.mark.parametrize("extra,param", REFUSED, ids=[str(e)[:40] for e, _ in REFUSED])
def test_fields_tide_cannot_honour_are_a_400_naming_the_field(url: str, fake: FakeEngine, extra: dict,
                                                              param: str) -> None:
    before = len(fake.requests)
    body = json.dumps({"prompt": "hi", **extra}).encode()  # writes NaN/Infinity literally, as some clients do
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param) and param in err["message"], err
    assert len(fake.requests) == before


@pytest.mark.parametrize("prompt,needle", [([100_000], "vocabulary"), ([], "empty"), (["a", "b"], "one prompt"),
                                           ([[1], [2]], "one prompt"), ([-5], "vocabulary")])
def test_bad_token_id_prompts(url: str, fake: FakeEngine, prompt: Any, needle: str) -> None:
    before = len(fake.requests)
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt})
    assert r.status_code == 400 and needle in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"
    assert len(fake.requests) == before


# --- part 2: hostile and broken requests ---------------------------------------------------------

def raw_exchange(url: str, head: str, chunks: Iterator[bytes], read_timeout_s: float = 5.0) -> tuple[str, int]:
    """Send ``head`` and then ``chunks`` until the server answers or stops reading; return the
    response's status line and how many body bytes went out before it did."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout_s) as sock:
        sock.sendall(head.encode())
        sock.setblocking(False)
        sent_bytes, answer = 0, b""
        deadline = time.monotonic() + read_timeout_s
        for chunk in chunks:
            try:
                answer += sock.recv(65536)
            except BlockingIOError:
                pass
            if answer:
                break
            try:
                sock.sendall(chunk)
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                break
            sent_bytes += len(chunk)
        sock.setblocking(True)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            while b"\r\n" not in answer:
                more = sock.recv(65536)
                if not more:
                    break
                answer += more
        except (TimeoutError, ConnectionResetError):
            pass
    return answer.split(b"\r\n", 1)[0].decode(), sent_bytes


def chunked(total_bytes: int, piece: int = 16_384) -> Iterator[bytes]:
    body = b'{"prompt": "' + b"x" * piece
    yield f"{len(body):x}\r\n".encode() + body + b"\r\n"
    for _ in range(total_bytes // piece):
        yield f"{piece:x}\r\n".encode() + b"x" * piece + b"\r\n"
    # never the terminating 0-chunk: a server that waits for the whole body never answers


@pytest.mark.parametrize("path,headers", [("/v1/completions", ""), ("/control/promote", f"Authorization: Bearer {TOKEN}\r\n")])
def test_chunked_body_over_the_cap_is_refused_while_it_streams(url: str, path: str, headers: str) -> None:
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
            "Transfer-Encoding: chunked\r\n\r\n")
    total_bytes = 64 * 1024 * 1024  # far beyond loopback socket buffers: a server that stops reading blocks us
    status, sent_bytes = raw_exchange(url, head, chunked(total_bytes, piece=65_536))
    assert status.startswith("HTTP/1.1 413"), status
    assert sent_bytes < total_bytes // 2  # the server stopped reading near the cap; buffers hold the rest
    assert httpx.get(url + "/health").status_code == 200


def test_declared_body_over_the_cap_is_refused_before_it_is_read(url: str) -> None:
    head = (f"POST /control/promote HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {10 * CAP_BYTES}\r\n\r\n")
    status, _ = raw_exchange(url, head, iter(()))
    assert status.startswith("HTTP/1.1 413"), status


def test_control_routes_check_the_token_before_reading_the_body(url: str) -> None:
    # not JSON, and never finished: only a token check that comes first can answer
    r = httpx.post(url + "/control/promote", content=b"garbage")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    head = "POST /control/promote HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    status, _ = raw_exchange(url, head, chunked(4 * CAP_BYTES))
    assert status.startswith("HTTP/1.1 401"), status


@pytest.mark.parametrize("version,status", [(2**70, 400), (0, 400), (2**31, 400), (7, 503)])
def test_out_of_range_version_numbers_are_a_400(url: str, version: int, status: int) -> None:
    r = httpx.post(url + "/control/promote", json={"version": version}, headers=AUTH)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "version"


def test_unauthenticated_health_shows_status_only(url: str) -> None:
    r = httpx.get(url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert SECRET_PATH not in r.text and "OperationalError" not in r.text and "ops" not in r.json()
    assert httpx.get(url + "/control/health").status_code == 401
    detailed = httpx.get(url + "/control/health", headers=AUTH).json()
    assert SECRET_PATH in detailed["ops"]["tracking_uri"] and detailed["status"] == "ok"


class BrokenStatsEngine(FakeEngine):
    def stats(self):
        raise RuntimeError(f"cannot read {SECRET_PATH}")


def test_health_failure_does_not_leak_the_exception(fake: FakeEngine) -> None:
    server = HttpServer(build_app(BrokenStatsEngine(), ServerConfig(control_token=TOKEN), ENGINE_CFG),
                        "127.0.0.1", 0, grace_s=1, log_level="critical")
    base = f"http://127.0.0.1:{server.start()}"
    try:
        r = httpx.get(base + "/health")
        assert r.status_code == 503 and r.json() == {"status": "error"}
        assert SECRET_PATH in httpx.get(base + "/control/health", headers=AUTH).text
    finally:
        server.stop()


def wait_until(predicate: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_non_streaming_request_is_cancelled_when_the_client_leaves(url: str, fake: FakeEngine) -> None:
    before = len(fake.requests)
    with pytest.raises(httpx.ReadTimeout):  # [slow]: 100 tokens take about 1.3 s
        httpx.post(url + "/v1/completions", json={"prompt": "[slow] bye", "max_tokens": 100}, timeout=0.3)
    rid = fake.requests[before].request_id
    assert wait_until(lambda: rid in fake.cancelled), "the engine request kept generating"
    assert wait_until(lambda: httpx.get(url + "/health").json()["inflight_requests"] == 0)


class HeldTokenizerEngine(FakeEngine):
    """FakeEngine whose tokenizer holds every prompt until ``release`` is set, as very long prompts
    would; ``tokenizing`` counts the prompts it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.tokenizing = 0
        count_lock = threading.Lock()
        encode = self.tokenizer.encode

        def held_encode(text: str, **kwargs: Any) -> list[int]:
            with count_lock:
                self.tokenizing += 1
            self.release.wait(60.0)  # bounded: a failing test still ends
            return encode(text, **kwargs)

        self.tokenizer.encode = held_encode


def test_health_answers_during_a_flood_of_slow_tokenization() -> None:
    from concurrent.futures import ThreadPoolExecutor

    engine = HeldTokenizerEngine()
    server = HttpServer(build_app(engine, ServerConfig(max_inflight_requests=100), ENGINE_CFG),
                        "127.0.0.1", 0, grace_s=1, log_level="warning")
    base = f"http://127.0.0.1:{server.start()}"
    pool = ThreadPoolExecutor(42)  # more than the shared thread pool's 40 threads
    try:
        client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=100))
        for _ in range(42):
            pool.submit(client.post, base + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        # every tokenizing thread is held, and held until the end: an answer queued behind them
        # would come only then, so these time out instead
        assert wait_until(lambda: engine.tokenizing >= TOKENIZE_THREADS, timeout_s=30.0)
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        assert httpx.get(base + "/metrics", timeout=10).status_code == 200
    finally:
        engine.release.set()
        pool.shutdown(wait=False, cancel_futures=True)  # the flood ends with the server
        server.stop()
