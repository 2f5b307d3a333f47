"""Slow and too many clients against the engine's HTTP server (connection limits and
read deadlines; tide/engine/http_conn.py, tide/engine/http_guard.py).

A real uvicorn server on loopback with FakeEngine behind it (tests/unit/engine/fake_engine.py) and
short deadlines; slow clients are raw sockets, because HTTP clients do not trickle their headers.
"""
from __future__ import annotations

import select
import socket
import time
from typing import Iterator

import httpx
import openai
import pytest
from fake_engine import FakeEngine

from tide.config import EngineConfig, ServerConfig
from tide.engine.server import HttpServer, build_app

ENGINE_CFG = EngineConfig(max_batch_size=8, max_new_tokens_limit=100, max_prompt_tokens=128,
                          default_max_new_tokens=16)
HEAD_S, BODY_S = 0.5, 0.5
SLACK_S = 1.0  # scheduling slack on a shared 2-core machine
RETRY_AFTER_S = 2


def start(max_connections: int = 64, evict_after_s: float = 60.0, idle_evict_after_s: float = 60.0,
          **kw) -> HttpServer:
    cfg = ServerConfig(**{"max_connections": max_connections, "header_timeout_s": HEAD_S, "body_timeout_s": BODY_S,
                          "retry_after_s": RETRY_AFTER_S, **kw})
    server = HttpServer(build_app(FakeEngine(), cfg, ENGINE_CFG), "127.0.0.1", 0, grace_s=1, log_level="warning")
    # the module's rules, shortened (or lengthened) for the test
    server.limits.evict_after_s, server.limits.idle_evict_after_s = evict_after_s, idle_evict_after_s
    server.port = server.start()
    return server


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    s = start()
    yield s
    s.stop()


class Raw:
    """A raw client socket that can trickle bytes and read one response (or the close)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def readable(self, timeout_s: float) -> bool:
        return bool(select.select([self.sock], [], [], timeout_s)[0])

    def response(self, timeout_s: float = 5.0) -> tuple[int | None, dict[str, str], bytes]:
        """(status, headers, body) of the next response; status None if the server closed first."""
        deadline = time.monotonic() + timeout_s
        while b"\r\n\r\n" not in self.buf:
            if not self._more(deadline):
                return None, {}, self.buf
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        size = int(headers.get("content-length", 0))
        while len(rest) < size and self._more(deadline):
            rest = self.buf.partition(b"\r\n\r\n")[2]
        self.buf = rest[size:]
        return int(lines[0].split()[1]), headers, rest[:size]

    def _more(self, deadline: float) -> bool:
        if not self.readable(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("no response and no close")
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def trickle(self, data: bytes, every_s: float, limit_s: float) -> tuple[int | None, dict[str, str], float]:
        """Send ``data`` one byte per ``every_s`` until the server answers; (status, headers, when)."""
        t0 = time.monotonic()
        for byte in data:
            if self.readable(every_s):
                break
            try:
                self.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            assert time.monotonic() - t0 < limit_s, "the server let a trickling client go on"
        status, headers, _ = self.response(limit_s)
        return status, headers, time.monotonic() - t0

    def close(self) -> None:
        self.sock.close()


SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 200 + b"\r\n\r\n"


def test_a_trickled_request_head_gets_408_at_its_deadline(server: HttpServer) -> None:
    raw = Raw(server.port)
    status, headers, took_s = raw.trickle(SLOW_HEAD, every_s=0.05, limit_s=HEAD_S + SLACK_S)
    assert status == 408 and headers["connection"] == "close"
    assert HEAD_S * 0.8 < took_s < HEAD_S + SLACK_S
    assert raw.response(SLACK_S)[0] is None  # then the server closes
    raw.close()


def test_a_silent_connection_is_closed_at_the_head_deadline(server: HttpServer) -> None:
    raw = Raw(server.port)
    t0 = time.monotonic()
    assert raw.response(HEAD_S + SLACK_S)[0] is None  # closed, nothing said: nothing was asked
    assert time.monotonic() - t0 > HEAD_S * 0.8
    raw.close()


def test_a_kept_alive_connection_trickling_its_next_head_gets_408(server: HttpServer) -> None:
    raw = Raw(server.port)
    raw.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert raw.response()[0] == 200
    # the head deadline restarts at the response's end, and keeps running while bytes trickle in
    status, _, took_s = raw.trickle(SLOW_HEAD, every_s=0.05, limit_s=HEAD_S + SLACK_S)
    assert status == 408 and took_s < HEAD_S + SLACK_S
    raw.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/control/ping"])
def test_a_trickled_body_gets_408_at_its_deadline(server: HttpServer, path: str) -> None:
    raw = Raw(server.port)
    body = b'{"prompt": "' + b"x" * 300 + b'", "max_tokens": 2}'
    raw.send(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             f"Authorization: Bearer t\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    status, headers, took_s = raw.trickle(body, every_s=0.05, limit_s=BODY_S + SLACK_S)
    # /control/ping has no configured token: its 401 comes before any body is read
    assert status == (408 if path.startswith("/v1") else 401) and headers["connection"] == "close"
    assert took_s < BODY_S + SLACK_S
    raw.close()


def test_a_refused_body_is_answered_not_reset(server: HttpServer) -> None:
    # the client sends its whole (too large) body without waiting: a server that closes with those
    # bytes unread resets the connection, and the client may never see the 413
    raw = Raw(server.port)
    body = b"x" * 2_000_000
    raw.send(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    try:
        raw.send(body)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server shut its side; the answer is still there to read
    assert raw.response()[0] == 413
    raw.close()


def slow_heads(port: int, n: int) -> list[Raw]:
    socks = [Raw(port) for _ in range(n)]
    for s in socks:
        s.send(b"GET /health HTTP/1.1\r\n")  # a head that has started and goes no further
    return socks


def await_heads_seen(server: HttpServer, n: int, timeout_s: float = 10.0) -> None:
    """Wait until the server has read part of a head on ``n`` connections: only then do they
    count as trickling heads (before, they are silent connections)."""
    deadline = time.monotonic() + timeout_s
    while sum(1 for conn in list(server.limits.waiting) if conn.head_bytes) < n:
        assert time.monotonic() < deadline, "the server never read the slow heads' first bytes"
        time.sleep(0.01)


def test_past_the_connection_limit_a_newcomer_gets_503_with_retry_after() -> None:
    server = start(max_connections=4)
    held = slow_heads(server.port, 4)
    try:
        r = httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S)
        assert r.json()["error"]["type"] == "server_overloaded"
    finally:
        [s.close() for s in held]
        server.stop()


def test_slow_heads_give_their_places_to_prompt_clients_and_health_stays_fast() -> None:
    slow_head_s = 10.0
    server = start(max_connections=8, evict_after_s=0.2, header_timeout_s=slow_head_s)
    held = slow_heads(server.port, 8)
    probes: list[Raw] = []
    try:
        await_heads_seen(server, 8)
        time.sleep(0.3)  # past evict_after_s: the slow heads may now be evicted
        for _ in range(8):  # each probe keeps its connection, so each needs a place of its own
            probes.append(Raw(server.port))
            probes[-1].send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            # a probe that had to wait for a place would wait for a head deadline: it times out
            assert probes[-1].response(timeout_s=slow_head_s / 2)[0] == 200
        # each probe evicted the oldest slow head, which was told to come back later
        answers = [s.response() for s in held]
        assert [a[0] for a in answers] == [503] * 8
        assert all(a[1]["retry-after"] == str(RETRY_AFTER_S) for a in answers)
    finally:
        [s.close() for s in held + probes]
        server.stop()


def test_a_trickled_head_is_evicted_before_an_older_idle_connection() -> None:
    server = start(max_connections=4, evict_after_s=0.1, idle_evict_after_s=0.1, header_timeout_s=10.0)
    idle = [Raw(server.port) for _ in range(2)]
    try:
        for c in idle:  # kept alive after a response: idle, and older than the slow heads below
            c.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert c.response()[0] == 200
        held = slow_heads(server.port, 2)
        await_heads_seen(server, 2)
        time.sleep(0.2)  # past both eviction ages
        assert httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5).status_code == 200
        assert held[0].response()[0] == 503  # the oldest trickling head went, not the idle ones
        for c in idle:  # still open and nothing said: the next answer is to the next request
            c.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert c.response()[0] == 200
    finally:
        [c.close() for c in idle + held]
        server.stop()


def test_a_busy_server_answers_503_with_retry_after_to_the_openai_client() -> None:
    server = start(max_inflight_requests=1)
    url = f"http://127.0.0.1:{server.port}"
    try:
        with httpx.Client(timeout=10) as c, c.stream("POST", url + "/v1/completions",
                                                     json={"prompt": "[slow]", "max_tokens": 60, "stream": True}) as held:
            assert held.status_code == 200
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(model="fake/tiny-model", prompt="hi", max_tokens=2)
            assert err.value.status_code == 503
            assert err.value.response.headers["retry-after"] == str(RETRY_AFTER_S)
    finally:
        server.stop()
