"""Connection limits and the request-head deadline, under uvicorn's HTTP parser.

uvicorn keeps every connection it accepts and reads a request head for as long as the client
takes: its keep-alive timer stops at the first byte, and its ``limit_concurrency`` counts idle and
half-sent connections too, then answers 503 without Retry-After. So a few hundred clients that
trickle their headers (slowloris) hold every connection. Here each connection is a
:class:`GuardedConnection`: an asyncio protocol that owns uvicorn's own protocol for that
connection and adds, with :class:`ConnectionLimits` holding the server-wide side:

- at most ``max_connections`` are served at once. A newcomer past that takes the place of the
  connection that has trickled part of a request head for longest (at least
  ``evict_after_s``; it is answered 503 with Retry-After), else of the one idle longest (at least
  ``idle_evict_after_s``: a kept-alive or silent connection, closed); when no connection may be
  taken (all are in requests or just started), the newcomer gets 503 with Retry-After. A client
  that sends its request promptly, a health probe say, so gets in while any connection is only
  trickling a head. Idle connections go last because closing one races with its client's next
  request (which then fails unanswered, as with any keep-alive close).
- a request head must be complete within ``header_timeout_s`` of the connection's start or of its
  previous response's end: else 408 if part of a head came, a plain close if nothing did.
- every close lingers: our side is shut (FIN), what the client still sends is read and dropped
  for at most ``LINGER_S``, then the socket closes. Closing with unread bytes makes the kernel
  reset the connection, and the client can lose the answer (413, 408, 503) before reading it.
  At most ``LINGER_MAX_BYTES`` are dropped, then reading stops until the socket closes: a client
  streaming a refused body on regardless gets no more read than that (nor its sender's rate
  times ``LINGER_S``); past that budget the reset comes as it would without lingering.

Only the parser knows where a head ends, so the ASGI side (tide/engine/http_guard.py) tells the
connection when its request started and when its response ended, through the handle it finds in
``scope["state"][CONNECTION_KEY]``. The body's deadline is kept there too.
"""
from __future__ import annotations

import asyncio
import json
import time
from http import HTTPStatus
from typing import Any, Callable

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from tide import metrics
from tide.engine import openai_api as api

CONNECTION_KEY = "tide.connection"
# a connection trickling a head may be evicted once its head is this old (not in the same burst of
# segments as its first byte). At the limit someone gets a 503 either way, the newcomer or the
# oldest trickling head; the latter is the likelier slow client, so this is kept short.
EVICT_AFTER_S = 0.01
# an idle connection (kept alive, or silent since it connected) may be evicted after this long
IDLE_EVICT_AFTER_S = 1.0
# how long a refused or closed connection is read and dropped before its socket closes
LINGER_S = 2.0
# how much of what a closed connection's client still sends is read and dropped, at most
LINGER_MAX_BYTES = 65_536


def raw_response(status: int, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    """A complete HTTP/1.1 response that closes the connection, for answers sent below the parser."""
    raw = json.dumps(body).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(raw)}", "connection: close"]
    head += [f"{k.lower()}: {v}" for k, v in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + raw


class ConnectionLimits:
    """The server-wide side: the limits, the connections served, and which wait for a head."""

    def __init__(self, max_connections: int, header_timeout_s: float, retry_after_s: int,
                 evict_after_s: float = EVICT_AFTER_S, idle_evict_after_s: float = IDLE_EVICT_AFTER_S,
                 inner: Callable[..., asyncio.Protocol] = AutoHTTPProtocol) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.retry_after_s = retry_after_s
        self.evict_after_s = evict_after_s
        self.idle_evict_after_s = idle_evict_after_s
        self.inner = inner  # uvicorn's protocol class (h11, or httptools where installed)
        self.served: set[GuardedConnection] = set()
        # connections waiting for a request head -> since when; insertion order is oldest first
        self.waiting: dict[GuardedConnection, float] = {}
        self.lingering: set[GuardedConnection] = set()

    def protocol(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: Any = None) -> GuardedConnection:
        """uvicorn's protocol factory: ``uvicorn.Config(http=limits.protocol)``."""
        def make_inner(state: dict[str, Any]) -> asyncio.Protocol:
            return self.inner(config=config, server_state=server_state, app_state=state, _loop=_loop)

        return GuardedConnection(self, make_inner, app_state)

    def admit(self, conn: GuardedConnection) -> bool:
        """Serve ``conn`` if there is room or an evictable connection; False: refuse it."""
        if len(self.served) >= self.max_connections:
            victim = self._victim()
            if victim is None:
                return False
            victim.evict()
        self.served.add(conn)
        metrics.HTTP_CONNECTIONS.set(len(self.served))
        return True

    def _victim(self) -> GuardedConnection | None:
        """The connection trickling a head for longest, else the one idle longest (module docstring)."""
        now, idle = time.monotonic(), None
        for conn, since in self.waiting.items():  # oldest first
            if now - since < min(self.evict_after_s, self.idle_evict_after_s):
                break  # the rest are younger still
            if conn.head_bytes and now - since >= self.evict_after_s:
                return conn
            if idle is None and not conn.head_bytes and now - since >= self.idle_evict_after_s:
                idle = conn
        return idle

    def release(self, conn: GuardedConnection, lingers: bool) -> None:
        self.served.discard(conn)
        self.waiting.pop(conn, None)
        if lingers:
            self.lingering.add(conn)
        else:
            self.lingering.discard(conn)
        metrics.HTTP_CONNECTIONS.set(len(self.served))


class _Transport:
    """The transport uvicorn's protocol sees: the real one, except that closing lingers."""

    def __init__(self, transport: asyncio.Transport, conn: GuardedConnection) -> None:
        self._transport = transport
        self._conn = conn

    def close(self) -> None:
        self._conn.close()

    def is_closing(self) -> bool:
        return self._conn.closing or self._transport.is_closing()

    def resume_reading(self) -> None:
        if not self._conn.closing:  # lingering: the connection decides what is still read
            self._transport.resume_reading()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedConnection(asyncio.Protocol):
    """One connection: limits and deadlines around uvicorn's protocol ``inner`` (module docstring)."""

    def __init__(self, limits: ConnectionLimits, make_inner: Callable[[dict[str, Any]], asyncio.Protocol],
                 app_state: dict[str, Any]) -> None:
        self.limits = limits
        # each connection's requests carry a handle to it in scope["state"] (copied per request)
        self.inner: Any = make_inner({**app_state, CONNECTION_KEY: self})
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.connected = False  # inner has seen connection_made
        self.closing = False
        self.awaiting_head = False
        self.head_bytes = 0
        self.dropped_bytes = 0  # read and dropped while lingering
        self._timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.limits.admit(self):
            metrics.HTTP_CONNECTIONS_REFUSED.labels("limit").inc()
            self.refuse(503, f"server at its connection limit ({self.limits.max_connections}); retry later")
            return
        self.connected = True
        self.inner.connection_made(_Transport(self.transport, self))
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self.closing:  # lingering: read and drop, up to the budget
            self.dropped_bytes += len(data)
            if self.dropped_bytes >= LINGER_MAX_BYTES:
                self.transport.pause_reading()
            return
        if self.awaiting_head:
            self.head_bytes += len(data)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.closing:
            return False  # the client is done: the transport closes now
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.closing = True
        self.limits.release(self, lingers=False)
        if self.connected:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.connected:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.connected:
            self.inner.resume_writing()

    # --- what the ASGI side tells (tide/engine/http_guard.py) --------------------------------------

    def request_started(self) -> None:
        """The parser has a whole request head: its deadline is met."""
        self.awaiting_head = False
        self.limits.waiting.pop(self, None)
        self._cancel_timer()

    def response_done(self) -> None:
        """The response's last byte is written: a kept-alive connection waits for its next head."""
        if not self.closing and not self.transport.is_closing():
            self._await_head()

    # --- refusals and closing ------------------------------------------------------------------------

    def refuse(self, status: int, message: str) -> None:
        """Answer ``status`` below the parser (no request is being served), then close."""
        headers = {"retry-after": str(self.limits.retry_after_s)} if status == 503 else {}
        kind = "server_overloaded" if status == 503 else "timeout"
        if not self.transport.is_closing():
            self.transport.write(raw_response(status, api.error_body(message, kind), headers))
        self.close()

    def evict(self) -> None:
        """Give this connection's place to a newcomer (it only waits for, or trickles, a head)."""
        metrics.HTTP_CONNECTIONS_REFUSED.labels("evicted").inc()
        if self.head_bytes:
            self.refuse(503, "server at its connection limit and this request head is slow; retry later")
        else:
            self.close()

    def close(self) -> None:
        """Close the lingering way (module docstring): FIN, then read and drop for LINGER_S."""
        if self.closing:
            return
        self.closing = True
        self._cancel_timer()
        lingers = (not self.transport.is_closing() and self.transport.can_write_eof()
                   and len(self.limits.lingering) < self.limits.max_connections)
        self.limits.release(self, lingers)
        if not lingers:
            self.transport.close()
            return
        try:
            self.transport.resume_reading()
            self.transport.write_eof()
        except OSError:  # the peer is gone already
            self.transport.abort()
            return
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, self.transport.abort)

    # --- the head deadline ---------------------------------------------------------------------------

    def _await_head(self) -> None:
        self.awaiting_head, self.head_bytes = True, 0
        self.limits.waiting.pop(self, None)
        self.limits.waiting[self] = time.monotonic()  # now the newest
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(self.limits.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._timer = None
        metrics.HTTP_CONNECTIONS_REFUSED.labels("header_timeout").inc()
        if self.head_bytes:
            self.refuse(408, f"request head not received within {self.limits.header_timeout_s:g} s")
        else:
            self.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
