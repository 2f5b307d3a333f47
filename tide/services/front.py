"""The local front: one address for N engine processes (``tide up --engines N``), round robin.

In Kubernetes the engine Service spreads requests over the replicas; locally this small proxy does:
1. each request goes to the next backend that is up (round robin), its response streamed back
   as it comes (SSE included);
2. a request is retried on another backend while none of its response has reached the client
   (it is not started, so retrying cannot duplicate output): the connection was refused or
   reset, the backend died or was marked down while the request waited, or it answered 503
   (draining, busy, failed) and another backend is up. Every retry is counted by reason;
3. a health monitor GETs each backend's ``/health`` every ``probe_s``: ``down_after`` probes in a
   row that get no answer (or a refused connection, or a 503 that says draining or failed) mark
   it down; a 503 for being busy or at its connection limit is an answer (it is alive). A backend
   down gets no new requests, and requests waiting on it for their first byte are cancelled and
   retried elsewhere, so a replica that hangs (SIGSTOP: it accepts connections and never answers)
   costs seconds, not a deadline;
4. once bytes went out, a request cannot be retried (replaying it would repeat output): a backend
   failure ends the client's stream with an error event (counted ``cut``), and so does a stream
   that sends nothing for ``stall_s`` once its backend is marked down (a hung replica); a stream
   that keeps coming from a backend the probes missed goes on;
5. with no backend up: 503 with Retry-After at once.
Every proxied answer names the backend that gave it (header ``x-tide-replica``).
``GET /health`` answers the front's view: backends, their drafter versions (``drafter_version`` is
theirs when all agree, else ``mixed``), the counters. The control API is per replica, never proxied.

Run: ``python -m tide.services.front --port 8000 --backend http://127.0.0.1:8101 --backend ...``
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger("tide.services.front")
# request headers not forwarded (hop-by-hop, or set by the client library for the new connection)
DROP_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "te", "upgrade"}
RETRY_AFTER_S = 1
REPLICA_HEADER = "x-tide-replica"  # on every proxied answer: the backend that gave it


class _Retry(Exception):
    """This attempt failed before any byte reached the client: try another backend."""


@dataclass
class Backend:
    url: str
    up: bool = True
    failures: int = 0
    version: str | None = None
    target_model: str = ""
    last_error: str | None = None
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set while down: waiters give up

    def mark(self, up: bool, why: str | None = None) -> None:
        if up and not self.up:
            log.info("backend %s is up", self.url)
            self.down = asyncio.Event()
        elif not up and self.up:
            log.warning("backend %s is down: %s", self.url, why)
            self.down.set()
        self.up, self.last_error = up, why if not up else self.last_error


class Front:
    def __init__(self, backends: list[str], probe_s: float = 1.0, probe_timeout_s: float = 3.0,
                 down_after: int = 2, stall_s: float = 5.0) -> None:
        self.backends = [Backend(u.rstrip("/")) for u in backends]
        self.probe_s, self.probe_timeout_s, self.down_after = probe_s, probe_timeout_s, down_after
        self.stall_s = stall_s
        self.counts: Counter[str] = Counter()
        self._next = 0
        self._client: httpx.AsyncClient | None = None

    # --- choosing and probing ---------------------------------------------------------------------
    def pick(self, tried: set[str]) -> Backend | None:
        n = len(self.backends)
        for i in range(n):
            b = self.backends[(self._next + i) % n]
            if b.up and b.url not in tried:
                self._next = (self._next + i + 1) % n
                return b
        return None

    async def monitor(self) -> None:
        async with httpx.AsyncClient(timeout=self.probe_timeout_s) as probe:
            while True:
                await asyncio.gather(*(self._probe(probe, b) for b in self.backends))
                await asyncio.sleep(self.probe_s)

    async def _probe(self, probe: httpx.AsyncClient, b: Backend) -> None:
        try:
            resp = await probe.get(f"{b.url}/health")
            status, body = resp.status_code, resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            b.failures += 1
            if b.failures >= self.down_after:
                b.mark(False, f"{type(exc).__name__}: {exc}")
            return
        b.failures = 0
        if status == 200:
            b.version, b.target_model = str(body.get("drafter_version")), body.get("target_model", "")
            b.mark(True)
        elif body.get("status") in ("draining", "failed"):  # it says so itself: no new requests
            b.mark(False, f"/health answered {status} ({body.get('status')})")
        # any other answer (503 busy, at its connection limit): alive, left as it was

    # --- proxying ---------------------------------------------------------------------------------
    async def proxy(self, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP_HEADERS}
        tried: set[str] = set()
        self.counts["requests"] += 1
        while (b := self.pick(tried)) is not None:
            tried.add(b.url)
            try:
                resp, first = await self._attempt(b, request.method, request.url.path, headers, body)
            except _Retry as exc:
                self.counts[f"retried:{exc}"] += 1
                log.info("request to %s not started (%s): retrying elsewhere", b.url, exc)
                continue
            if resp.status_code == 503 and self.pick(tried) is not None:
                await resp.aclose()
                self.counts["retried:503"] += 1
                continue
            out = {k: v for k, v in resp.headers.items() if k.lower() not in DROP_HEADERS | {"content-encoding"}}
            out[REPLICA_HEADER] = b.url  # which replica answered: a failure is traced to it
            return StreamingResponse(self._rest(b, resp, first), status_code=resp.status_code, headers=out)
        self.counts["no_backend"] += 1
        return JSONResponse({"error": {"message": "no engine replica is up; retry", "type": "server_error",
                                       "code": 503}}, 503, headers={"Retry-After": str(RETRY_AFTER_S)})

    async def _attempt(self, b: Backend, method: str, path: str, headers: dict, body: bytes):
        """Response headers and the first body chunk, or _Retry: nothing has reached the client."""
        req = self._client.build_request(method, b.url + path, headers=headers, content=body)
        resp = await self._unless_down(b, self._client.send(req, stream=True))
        chunks = resp.aiter_raw()
        try:
            first = await self._unless_down(b, anext(chunks, b""))
        except _Retry:
            await resp.aclose()
            raise
        return resp, (first, chunks)

    async def _unless_down(self, b: Backend, awaitable, keep: bool = False):
        """``awaitable``'s result; _Retry if ``b`` is marked down first (with ``keep``: unless it
        still finishes within ``stall_s`` after that) or fails in transport."""
        task, down = asyncio.ensure_future(awaitable), asyncio.ensure_future(b.down.wait())
        try:
            await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
        if not task.done():
            if not keep:
                task.cancel()
                raise _Retry("backend_down")
            if not (await asyncio.wait({task}, timeout=self.stall_s))[0]:
                task.cancel()
                raise _Retry("stalled")
        try:
            return task.result()
        except httpx.ConnectError as exc:
            b.mark(False, f"{type(exc).__name__}: {exc}")
            raise _Retry("connect_failed") from exc
        except httpx.TransportError as exc:  # reset, closed without answering: it died or is dying
            raise _Retry("reset") from exc

    async def _rest(self, b: Backend, resp: httpx.Response, first_and_rest):
        first, chunks = first_and_rest
        try:
            chunk = first
            while chunk:
                yield chunk
                chunk = await self._next_chunk(b, chunks)
        except _Retry as exc:  # started: it cannot be replayed, so the client's stream ends here
            self.counts["cut"] += 1
            log.warning("backend %s failed mid-response (%s): the client's stream is cut", b.url, exc)
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                yield (b'data: {"error": {"message": "the engine replica serving this stream went away", '
                       b'"type": "server_error", "code": 502}}\n\n')
        finally:
            await resp.aclose()

    async def _next_chunk(self, b: Backend, chunks) -> bytes:
        """The next chunk; _Retry when the backend fails, or is down and sends nothing for ``stall_s``."""
        return await self._unless_down(b, anext(chunks, b""), keep=True)

    def health(self, _: Request) -> JSONResponse:
        up = [b for b in self.backends if b.up]
        versions = {b.version for b in up}
        body = {"status": "ok" if up else "unavailable",
                "drafter_version": versions.pop() if len(versions) == 1 else "mixed",
                "target_model": next((b.target_model for b in up), ""),
                "backends": [{"url": b.url, "up": b.up, "drafter_version": b.version, "last_error": b.last_error}
                             for b in self.backends],
                "counts": dict(self.counts)}
        return JSONResponse(body, 200 if up else 503)

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=3.0),
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
            monitor = asyncio.ensure_future(self.monitor())
            try:
                yield
            finally:
                monitor.cancel()
                await self._client.aclose()

        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/{rest:path}", self.proxy, methods=["GET", "POST"])]
        return Starlette(routes=routes, lifespan=lifespan)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tide.services.front",
                                     description="TIDE front: one address for several engine processes")
    parser.add_argument("--backend", action="append", required=True, help="an engine's base URL (repeat)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--probe-s", type=float, default=1.0, help="health probe interval")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def serve(front: Front, host: str, port: int, stop: threading.Event) -> None:
    server = uvicorn.Server(uvicorn.Config(front.app(), host=host, port=port, log_level="warning",
                                           access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, name="tide-front", daemon=True)
    thread.start()
    log.info("front on http://%s:%d for %s", host, port, ", ".join(b.url for b in front.backends))
    stop.wait()
    server.should_exit = True
    thread.join(10)


def main(argv: list[str] | None = None) -> int:
    import signal

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    serve(Front(args.backend, args.probe_s), args.host, args.port, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
