"""ASGI layers in front of the engine's routes: request metrics, control auth, the body's cap and
deadline.

They sit at the ASGI level, before FastAPI reads anything, because that is the only place where
- the control token is checked before a control route's body is read or parsed (FastAPI parses a
  body parameter before it runs the route's dependencies);
- the body cap holds while the body streams: a declared Content-Length over the cap is refused
  before one byte is read, and a chunked (or under-declared) body is refused with 413 as soon as
  the bytes received pass the cap; the rest is not read (the connection closes, and drops at
  most ``LINGER_MAX_BYTES`` of it while it lingers: tide/engine/http_conn.py);
- the body must arrive within ``body_timeout_s`` of its head, else 408 (a client trickling its
  body holds no more than that);
- the connection (tide/engine/http_conn.py) learns that its request head came and when its
  response ended, which its head deadline and connection limit need.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request

from tide import metrics
from tide.engine import openai_api as api
from tide.engine.http_conn import CONNECTION_KEY

CONTROL_PREFIX = "/control"


def control_refusal(expected: str, authorization: str) -> str | None:
    """Why ``Authorization: <authorization>`` may not use the control API; None when it may.

    An empty configured token disables the control API (refused for everyone), so a default
    deployment exposes no operations.
    """
    if not expected:
        return "control API disabled: set server.control_token"
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected.encode()):
        return "missing or wrong bearer token for the control API"
    return None


def require_control_token(request: Request) -> None:
    """FastAPI dependency with the same check, for routes mounted outside HttpGuard's prefix."""
    why = control_refusal(request.app.state.control_token, request.headers.get("authorization", ""))
    if why:
        raise HTTPException(401, why, headers={"WWW-Authenticate": "Bearer"})


async def _send_json(send: Any, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    raw = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw})


def _telling(send: Any, conn: Any) -> Any:
    """``send`` that tells the connection when the response's last byte went out."""
    async def send_and_tell(message: Any) -> None:
        await send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            conn.response_done()
    return send_and_tell


class HttpGuard:
    """ASGI middleware: control token first, then the body's cap and deadline on every route."""

    def __init__(self, app: Any, max_body_bytes: int, control_token: str, body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.control_token = control_token
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        conn = scope.get("state", {}).get(CONNECTION_KEY)  # absent under another ASGI server
        if conn is not None:
            conn.request_started()
            send = _telling(send, conn)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["path"] == CONTROL_PREFIX or scope["path"].startswith(CONTROL_PREFIX + "/"):
            why = control_refusal(self.control_token, headers.get("authorization", ""))
            if why:
                await _send_json(send, 401, api.error_body(why, "authentication_error"),
                                 {"WWW-Authenticate": "Bearer", "Connection": "close"})
                return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_json(send, 413, self._too_large(f"{declared} bytes").body(), {"Connection": "close"})
            return
        await self._capped(scope, receive, send)

    def _too_large(self, size: str) -> api.APIError:
        return api.APIError(413, f"request body of {size} exceeds {self.max_body_bytes} bytes")

    async def _capped(self, scope: Any, receive: Any, send: Any) -> None:
        """Run the app; once the body passes the cap or its deadline, answer 413 / 408 here and tell
        the app the client left (frameworks turn errors raised while reading a body into 400s)."""
        received, started, refused, body_done = 0, False, False, False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def refuse(error: api.APIError) -> dict[str, str]:
            nonlocal refused
            if not started and not refused:
                refused = True
                await _send_json(send, error.status, error.body(), {"Connection": "close"})
            return {"type": "http.disconnect"}

        async def capped_receive() -> Any:
            nonlocal received, body_done
            if body_done:  # from here on receive() only reports a disconnect: no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                metrics.HTTP_CONNECTIONS_REFUSED.labels("body_timeout").inc()
                return await refuse(api.APIError(408, f"request body not received within {self.body_timeout_s:g} s",
                                                 "timeout"))
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    return await refuse(self._too_large(f"more than {self.max_body_bytes} bytes"))
                body_done = not message.get("more_body", False)
            return message

        async def guarded_send(message: Any) -> None:
            nonlocal started
            if refused:  # the 413 went out already; whatever the app says now has no reader
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, capped_receive, guarded_send)


class HttpMetrics:
    """ASGI middleware: request count by route/status and time to the last byte (streams too)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # label by known route path only: raw URLs would make label cardinality unbounded
        routes = {getattr(r, "path", None) for r in scope["app"].routes}
        route = scope["path"] if scope["path"] in routes else "other"
        status = [500]
        t0 = time.perf_counter()

        async def send_and_watch(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            metrics.HTTP_REQUESTS.labels(route, str(status[0])).inc()
            metrics.HTTP_REQUEST_SECONDS.labels(route).observe(time.perf_counter() - t0)
