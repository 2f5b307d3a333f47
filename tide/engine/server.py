"""The engine's HTTP front end: OpenAI-compatible completions, health, metrics, control auth.

Routes (one small handler each, in ``_Routes``):
- ``POST /v1/completions``, ``POST /v1/chat/completions``: read the body, validate it
  (tide/engine/openai_api.py; 400 naming the field), then tide/engine/generation.py runs it;
- ``GET /v1/models``; ``GET /metrics`` (Prometheus);
- ``GET /health``: status and counters only, safe to expose; ``GET /control/health`` adds the
  engine's and the drafter follower's details (paths, registry state, last errors);
- ``POST /control/ping`` and tide/ops/control_api.py under ``/control``: behind the bearer token.
With ``server.control_port`` set, ``/control/*`` is served only on that port (``surface``
"control", with /health and /metrics so that ``tide drafters --engine`` needs one URL) and the
API port leaves it out ("api"): a NetworkPolicy can then limit who reaches the control routes,
which a path on a shared port would not allow.
tide/engine/http_guard.py checks the control token and the body cap before any route reads a byte.
Errors are OpenAI-style bodies; a 500 never carries exception text (that goes to the log).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from tide.config import EngineConfig, ServerConfig
from tide.engine import openai_api as api
from tide.engine import openai_responses as responses
from tide.engine.base import Engine
from tide.engine.generation import ClientGone, Generations, unless_client_leaves
from tide.engine.http_conn import ConnectionLimits
from tide.engine.http_guard import HttpGuard, HttpMetrics, require_control_token
from tide.engine.request_stream import Admission

log = logging.getLogger(__name__)
# nginx's status for "client closed request": only the log and metrics ever see it
CLIENT_CLOSED_REQUEST = 499


class _SSEResponse(StreamingResponse):
    """StreamingResponse that always runs ``on_close``, even when the body never started."""

    def __init__(self, content: Any, on_close: Any, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclass(frozen=True)
class ControlPlane:
    """What a service mounts next to the engine's routes (the engine knows nothing of ops): a router
    served under the control token, and a health view added to /control/health as ``ops``."""

    router: APIRouter
    health: Callable[[], dict[str, Any]]


class _Routes:
    """The handlers, one per route, over one engine (the route table is in build_app)."""

    def __init__(self, engine: Engine, cfg: ServerConfig, engine_cfg: EngineConfig,
                 ops: ControlPlane | None) -> None:
        self.engine = engine
        self.engine_cfg = engine_cfg
        self.ops = ops
        self.admission = Admission(cfg.max_inflight_requests, cfg.retry_after_s)
        limits = api.Limits(engine.max_seq_len, engine_cfg.max_prompt_tokens,
                            engine_cfg.max_new_tokens_limit, engine_cfg.default_max_new_tokens)
        self.gen = Generations(engine, limits, self.admission)
        self.started_at = time.time()

    async def _read(self, request: Request, model: type) -> Any:
        # the body cap is HttpGuard's: it holds while the body streams
        req = api.parse_body(model, await request.body())
        served = self.engine.target_model_id
        if req.model not in (None, served, served.rsplit("/", 1)[-1]):
            raise api.APIError(404, f"model '{req.model}' is not served here; this engine serves "
                                    f"'{served}'", "model_not_found", "model")
        return req

    async def _respond(self, request: Request, req: Any, chat: bool) -> Response:
        try:
            job = await unless_client_leaves(request.receive, self.gen.start(req, chat))
            if req.stream:
                return _SSEResponse(self.gen.events(job), on_close=lambda: self.gen.finish(job),
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                             "X-Request-Id": job.rid})
            text = await unless_client_leaves(request.receive, self.gen.collect(job))
        except ClientGone:
            log.info("client left before its response started; request cancelled")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(self.gen.body(job, text))

    async def completions(self, request: Request) -> Response:
        return await self._respond(request, await self._read(request, api.CompletionRequest), chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._respond(request, await self._read(request, api.ChatCompletionRequest), chat=True)

    async def models(self) -> dict[str, Any]:
        return responses.models_body(self.engine.target_model_id, int(self.started_at))

    def _status(self) -> dict[str, Any]:
        st = self.engine.stats()
        return {"status": "draining" if self.admission.draining else "ok",
                "drafter_version": self.engine.drafter_version,
                "target_model": self.engine.target_model_id, "max_seq_len": self.engine.max_seq_len,
                "max_batch_size": self.engine_cfg.max_batch_size,
                "batch_size": REGISTRY.get_sample_value("tide_engine_batch_size"),
                "queue_depth": REGISTRY.get_sample_value("tide_engine_queue_depth"),
                "inflight_requests": self.admission.count, "max_inflight_requests": self.admission.limit,
                "requests_finished": st.requests_finished, "requests_failed": st.requests_failed,
                "tokens_generated": st.tokens_generated, "uptime_s": round(time.time() - self.started_at, 1)}

    def health(self) -> JSONResponse:  # sync: engine.stats() may wait on the engine's lock
        """Status and counters only: unauthenticated callers learn nothing about the deployment."""
        failure = self.engine.failure
        if failure is not None:  # a dead decode loop: the liveness probe restarts the process
            return JSONResponse({"status": "failed", "reason": failure}, 503)
        try:
            body = self._status()
        except Exception:  # noqa: BLE001 - health must answer, not crash; the text is for the log
            log.exception("/health failed")
            return JSONResponse({"status": "error"}, 503)
        return JSONResponse(body, 503 if self.admission.draining else 200)

    def control_health(self) -> JSONResponse:
        """/health plus the engine's and the follower's details and errors, for token holders."""
        try:
            body = self._status()
            body["engine"] = self.engine.health()
            if self.ops is not None:
                body["ops"] = self.ops.health()
        except Exception as exc:  # noqa: BLE001 - the token holder may see the reason
            log.exception("/control/health failed")
            return JSONResponse({"status": "error", "error": f"{type(exc).__name__}: {exc}"}, 503)
        if self.engine.failure is not None:
            body.update(status="failed", reason=self.engine.failure)
            return JSONResponse(body, 503)
        return JSONResponse(body, 503 if self.admission.draining else 200)

    def metrics(self) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def control_ping(self) -> dict[str, Any]:
        return {"ok": True, "drafter_version": self.engine.drafter_version}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(api.APIError)
    async def _api_error(_: Request, exc: api.APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "authentication_error" if exc.status_code == 401 else "invalid_request_error"
        return JSONResponse(api.error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return JSONResponse(api.error_body(f"invalid value for '{where}': {first.get('msg', 'invalid')}",
                                           "invalid_request_error", where), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _client_left(_: Request, exc: ClientDisconnect) -> Response:
        # the client left mid-body, or HttpGuard refused the body (413 already sent)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in request")  # the text stays in the log
        return JSONResponse(api.error_body("internal error; details are in the server log",
                                           "server_error"), status_code=500)


SURFACES = ("all", "api", "control")


def build_app(engine: Engine, cfg: ServerConfig, engine_cfg: EngineConfig,
              ops: ControlPlane | None = None, surface: str = "all") -> FastAPI:
    """The FastAPI app over ``engine``; routes are listed in this module's docstring.

    ``ops`` (tide.ops.control_api.control_plane) adds the drafter control API under /control,
    behind the control token, and its state to /control/health. ``surface``: "all" routes, the
    "api" without /control, or only the "control" routes.
    """
    if surface not in SURFACES:
        raise ValueError(f"surface must be one of {SURFACES}, got {surface!r}")
    app = FastAPI(title="TIDE engine", version="0.1.0")
    routes = _Routes(engine, cfg, engine_cfg, ops)
    app.state.control_token = cfg.control_token
    app.state.server_config = cfg
    app.state.engine = engine
    app.state.admission = routes.admission
    app.state.generations = routes.gen
    app.add_middleware(HttpGuard, max_body_bytes=cfg.max_body_bytes, control_token=cfg.control_token,
                       body_timeout_s=cfg.body_timeout_s)
    app.add_middleware(HttpMetrics)  # outermost: counts the guard's refusals too
    _install_error_handlers(app)
    if surface != "control":
        app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
        app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    if surface != "api":
        auth = [Depends(require_control_token)]
        app.add_api_route("/control/ping", routes.control_ping, methods=["POST"], dependencies=auth)
        app.add_api_route("/control/health", routes.control_health, methods=["GET"], dependencies=auth)
        if ops is not None:
            app.include_router(ops.router, dependencies=auth)
    return app


class HttpServer:
    """uvicorn in a background thread (so it installs no signal handlers of its own), each connection
    under tide/engine/http_conn.py's limits and head deadline (those of build_app's ServerConfig)."""

    def __init__(self, app: FastAPI, host: str, port: int, grace_s: float = 10.0,
                 log_level: str = "info") -> None:
        self.app = app
        cfg: ServerConfig = app.state.server_config
        self.limits = ConnectionLimits(cfg.max_connections, cfg.header_timeout_s, cfg.retry_after_s)
        self._server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="off", access_log=False,
            http=self.limits.protocol, timeout_keep_alive=cfg.keep_alive_timeout_s,  # type: ignore[arg-type]
            timeout_graceful_shutdown=max(1, int(grace_s))))
        self._thread = threading.Thread(target=self._server.run, name="tide-http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> int:
        """Start serving; return the bound port (useful with port 0)."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("HTTP server failed to start (port in use? see log above)")
            time.sleep(0.01)
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        admission = getattr(self.app.state, "admission", None)
        if admission is not None:
            admission.draining = True
        self._server.should_exit = True
        self._thread.join(timeout_s)
        generations = getattr(self.app.state, "generations", None)
        if generations is not None:
            generations.close()


def serve(app: FastAPI, host: str, port: int, stop_event: threading.Event, grace_s: float = 10.0,
          also: tuple[tuple[FastAPI, int], ...] = ()) -> None:
    """Serve until ``stop_event`` is set (e.g. by a SIGTERM handler), then drain and return.
    ``also``: more (app, port) pairs on the same host (the control surface's own port)."""
    servers = []
    try:
        for one, one_port in ((app, port), *also):
            server = HttpServer(one, host, one_port, grace_s)
            servers.append(server)
            log.info("serving on http://%s:%d", host, server.start())
        while not stop_event.wait(0.5):
            if not all(s.alive for s in servers):
                raise RuntimeError("HTTP server stopped unexpectedly")
    finally:
        for server in servers:
            server.stop(timeout_s=grace_s + 5)
