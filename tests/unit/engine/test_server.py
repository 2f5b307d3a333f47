"""The engine's HTTP front end, exercised through a real uvicorn server on loopback with httpx.

The engine behind it is FakeEngine: a FAKE that implements the Engine interface of
tide/engine/base.py without any model, so these tests check the HTTP layer (validation, streaming,
stop strings, errors, cancellation, auth, metrics) in well under a minute. The real reference
engine is tested behind the same server elsewhere.
"""
from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest
from fake_engine import TOKEN, FakeEngine

from tide.config import EngineConfig, ServerConfig, replace
from tide.engine.server import HttpServer, build_app, serve

ENGINE_CFG = EngineConfig(max_batch_size=8, max_new_tokens_limit=100, max_prompt_tokens=128,
                          default_max_new_tokens=16)


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def url(fake: FakeEngine) -> Iterator[str]:
    cfg = ServerConfig(host="127.0.0.1", port=0, control_token=TOKEN, max_body_bytes=65_536)
    server = HttpServer(build_app(fake, cfg, ENGINE_CFG), "127.0.0.1", 0, grace_s=1, log_level="warning")
    port = server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def sse_payloads(response: httpx.Response) -> list[Any]:
    """Parsed ``data:`` payloads; the literal [DONE] marker is kept as the string "[DONE]"."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_payloads(r)


def text_of(fake: FakeEngine, n: int) -> str:
    return fake.tokenizer.decode(fake.expected_ids(n))


def test_completion_non_stream(url: str, fake: FakeEngine) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 30, "seed": 7,
                                                  "temperature": 0.5, "top_p": 0.9,
                                                  "workload": "code", "capture": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == text_of(fake, 30)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 30, "total_tokens": 35}
    assert body["tide"]["drafter_version"] == "fake-v1" and body["tide"]["tokens_per_step"] > 1
    req = next(q for q in fake.requests if q.request_id == body["id"])
    assert req.prompt_ids == tuple(fake.tokenizer.encode("Hello"))
    s = req.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.seed) == (30, 0.5, 0.9, 7)
    assert s.stop_token_ids == (fake.tokenizer.eos_token_id,)
    assert (req.workload, req.capture) == ("code", False)


def test_completion_default_max_tokens_and_unique_ids(url: str, fake: FakeEngine) -> None:
    ids = set()
    for _ in range(3):
        body = httpx.post(url + "/v1/completions", json={"prompt": "x"}).json()
        assert body["usage"]["completion_tokens"] == ENGINE_CFG.default_max_new_tokens
        ids.add(body["id"])
    assert len(ids) == 3


def test_completion_stream_matches_non_stream(url: str, fake: FakeEngine) -> None:
    # 60 tokens crosses the multi-byte characters of SCRIPT, split across events
    payloads = stream(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 60, "stream": True,
                                               "stream_options": {"include_usage": True}})
    assert payloads[-1] == "[DONE]"
    chunks, usage = payloads[:-2], payloads[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text_of(fake, 60)
    assert all("\ufffd" not in c["choices"][0]["text"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 60


def test_continuous_usage_stats_put_usage_on_every_chunk(url: str) -> None:
    """vLLM's stream_options.continuous_usage_stats, which guidellm sends (was a 400)."""
    payloads = stream(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    content = [p for p in payloads[:-1] if p["choices"] and p["choices"][0]["delta"].get("content")]
    counts = [p["usage"]["completion_tokens"] for p in content]
    assert counts == sorted(counts) and 0 < counts[0] and counts[-1] <= 20
    assert all(p["usage"]["prompt_tokens"] == content[0]["usage"]["prompt_tokens"] for p in content)
    assert payloads[-2]["choices"] == [] and payloads[-2]["usage"]["completion_tokens"] == 20


def test_chat_non_stream_applies_template(url: str, fake: FakeEngine) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 12,
                                                       "model": fake.target_model_id})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text_of(fake, 12)}
    req = next(q for q in fake.requests if q.request_id == body["id"])
    rendered = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert req.prompt_ids == tuple(fake.tokenizer.encode(rendered, add_special_tokens=False))
    assert body["usage"]["prompt_tokens"] == len(req.prompt_ids)


def test_chat_stream(url: str, fake: FakeEngine) -> None:
    payloads = stream(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "yo"}],
                                                    "max_tokens": 50, "stream": True})
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == text_of(fake, 50)
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


def test_eos_finishes_with_stop_and_is_not_in_text(url: str, fake: FakeEngine) -> None:
    body = httpx.post(url + "/v1/completions", json={"prompt": "[eos:9]", "max_tokens": 40}).json()
    assert body["choices"][0] == {"index": 0, "text": text_of(fake, 8), "logprobs": None,
                                  "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == 9


@pytest.mark.parametrize("streamed", [False, True])
def test_stop_string_cuts_text_and_cancels_engine(url: str, fake: FakeEngine, streamed: bool) -> None:
    # "fox" appears at characters 16-18; the rest of the 90-token budget must not be generated
    body = {"prompt": "p", "max_tokens": 90, "stop": ["zzz", "fox"], "stream": streamed}
    if streamed:
        chunks = stream(url, "/v1/completions", body)[:-1]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        reason, rid = chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["id"]
    else:
        out = httpx.post(url + "/v1/completions", json=body).json()
        text, reason, rid = out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["id"]
    assert text == "The quick brown " and reason == "stop"
    deadline = time.monotonic() + 5
    while rid not in fake.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rid in fake.cancelled


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "foo": 1}, 400, "foo"),
    ("/v1/completions", b"{not json", 400, "JSON"),
    ("/v1/completions", b"[1, 2]", 400, "object"),
    ("/v1/completions", b"", 400, "empty"),
    ("/v1/completions", {"prompt": "a" * 129}, 400, "129 tokens"),
    ("/v1/completions", {"prompt": "a" * 120, "max_tokens": 100}, 400, "context of 200"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 101}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n=1"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": 123}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "workload": "bad tag!"}, 400, "workload"),
    ("/v1/completions", {"prompt": "hi", "capture": "no"}, 400, "capture"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/completions", {"prompt": "x" * 70_000}, 413, "exceeds"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, 400, "x"),
    ("/v1/chat/completions", {"prompt": "hi"}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 200}]}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD_REQUESTS,
                         ids=[f"{i}-{b if isinstance(b, bytes) else list(b)}"[:40] for i, (_, b, _, _) in enumerate(BAD_REQUESTS)])
def test_bad_request_is_rejected_and_server_keeps_serving(url: str, fake: FakeEngine, path: str,
                                                          body: Any, status: int, needle: str) -> None:
    before = len(fake.requests)
    if isinstance(body, bytes):
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower(), err
    assert err["type"] in ("invalid_request_error", "model_not_found")
    assert len(fake.requests) == before  # nothing reached the engine
    assert httpx.get(url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("marker,status,needle", [("[raise]", 500, "server log"),
                                                  ("[reject]", 400, "does not like"),
                                                  ("[error-event]", 500, "server log")])
def test_engine_failures_get_a_status_and_message(url: str, marker: str, status: int, needle: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": marker, "max_tokens": 20})
    message = r.json()["error"]["message"]
    assert r.status_code == status and needle in message
    # a 500 names the request for the log, never the exception's own text
    assert "exploded" not in message and "fake step failed" not in message
    assert httpx.get(url + "/health").status_code == 200
    ok = httpx.post(url + "/v1/completions", json={"prompt": "fine", "max_tokens": 3})
    assert ok.status_code == 200


def test_engine_error_mid_stream_is_reported_in_band(url: str) -> None:
    payloads = stream(url, "/v1/completions", {"prompt": "[error-event]", "max_tokens": 20, "stream": True})
    assert payloads[-1] == "[DONE]"
    message = payloads[-2]["error"]["message"]
    assert "server log" in message and "fake step failed" not in message
    assert "".join(p["choices"][0]["text"] for p in payloads[:-2]) == "The"  # 1 + 2 tokens before


def test_control_token(url: str) -> None:
    assert httpx.post(url + "/control/ping").status_code == 401
    r = httpx.post(url + "/control/ping", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.post(url + "/control/ping", headers={"Authorization": TOKEN}).status_code == 401
    r = httpx.post(url + "/control/ping", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json() == {"ok": True, "drafter_version": "fake-v1"}


def test_control_disabled_without_configured_token(fake: FakeEngine) -> None:
    app = build_app(fake, ServerConfig(control_token=""), ENGINE_CFG)
    server = HttpServer(app, "127.0.0.1", 0, grace_s=1, log_level="warning")
    base = f"http://127.0.0.1:{server.start()}"
    try:
        for header in ({}, {"Authorization": "Bearer"}, {"Authorization": "Bearer x"}):
            r = httpx.post(base + "/control/ping", headers=header)
            assert r.status_code == 401 and "disabled" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_health_models_metrics(url: str, fake: FakeEngine) -> None:
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["drafter_version"] == "fake-v1"
    assert health["target_model"] == fake.target_model_id and health["max_batch_size"] == 8
    assert {"batch_size", "queue_depth", "inflight_requests"} <= set(health)
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [fake.target_model_id]
    httpx.post(url + "/v1/completions", json={"prompt": "hi", "foo": 1})
    assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    text = httpx.get(url + "/metrics").text
    assert "tide_engine_batch_size" in text and "tide_engine_time_to_first_token_seconds_count" in text
    assert re.search(r'tide_engine_http_requests_total\{route="/v1/completions",status="400"\} [1-9]', text)
    assert re.search(r'tide_engine_http_requests_total\{route="/v1/completions",status="200"\} [1-9]', text)
    assert httpx.get(url + "/no/such/path").status_code == 404
    assert 'route="other",status="404"' in httpx.get(url + "/metrics").text


def test_concurrent_streams_all_complete_and_loop_stays_responsive(url: str, fake: FakeEngine) -> None:
    def one(i: int) -> tuple[str, str]:
        chunks = stream(url, "/v1/completions", {"prompt": f"[slow] {i}", "max_tokens": 24, "stream": True})
        assert chunks[-1] == "[DONE]"
        return "".join(c["choices"][0]["text"] for c in chunks[:-1]), chunks[-2]["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        time.sleep(0.1)
        t0 = time.perf_counter()
        assert httpx.get(url + "/health").status_code == 200
        health_s = time.perf_counter() - t0
        results = [f.result(timeout=60) for f in futures]
    assert results == [(text_of(fake, 24), "length")] * 8
    # each stream sleeps ~240 ms in blocking engine calls; a blocked event loop would show here
    assert health_s < 1.5, health_s  # a loop blocked by 8 streams would take ~1.9 s; CI shares 2 cores


def test_client_disconnect_cancels_engine_request(url: str, fake: FakeEngine) -> None:
    with httpx.stream("POST", url + "/v1/completions",
                      json={"prompt": "[slow] bye", "max_tokens": 100, "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        rid = json.loads(first[len("data: "):])["id"]
    deadline = time.monotonic() + 5
    while rid not in fake.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rid in fake.cancelled
    req = next(q for q in fake.requests if q.request_id == rid)
    assert fake.stats().tokens_generated > 0 and req.sampling.max_new_tokens == 100
    deadline = time.monotonic() + 5
    while httpx.get(url + "/health").json()["inflight_requests"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert httpx.get(url + "/health").json()["inflight_requests"] == 0


def test_inflight_limit_answers_503(fake: FakeEngine) -> None:
    cfg = ServerConfig(max_inflight_requests=1)
    server = HttpServer(build_app(fake, cfg, ENGINE_CFG), "127.0.0.1", 0, grace_s=1, log_level="warning")
    base = f"http://127.0.0.1:{server.start()}"
    try:
        with httpx.stream("POST", base + "/v1/completions",
                          json={"prompt": "[slow]", "max_tokens": 30, "stream": True}) as first:
            assert first.status_code == 200
            r = httpx.post(base + "/v1/completions", json={"prompt": "second", "max_tokens": 3})
            assert r.status_code == 503 and "busy" in r.json()["error"]["message"]
            first.read()
        assert httpx.post(base + "/v1/completions", json={"prompt": "third", "max_tokens": 3}).status_code == 200
    finally:
        server.stop()


def test_serve_returns_when_stop_event_is_set(fake: FakeEngine) -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop = threading.Event()
    app = build_app(fake, replace(ServerConfig(), port=port), ENGINE_CFG)
    t = threading.Thread(target=serve, args=(app, "127.0.0.1", port, stop), kwargs={"grace_s": 1})
    t.start()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            break
        except httpx.ConnectError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    stop.set()
    t.join(10)
    assert not t.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")
