"""The engine's HTTP front end: OpenAI-compatible completions, health, metrics, control auth.

A generation request goes through these steps:
1. read the body (size-capped) and validate it (tide/engine/openai_api.py): 400 on any problem;
2. tokenize the prompt, or render the chat template and tokenize, in a worker thread;
3. check prompt length and max_tokens against the engine's context and EngineConfig limits;
4. admit it if fewer than ``max_inflight_requests`` are being served (else 503);
5. run the engine's blocking iterator in a dedicated thread (EngineStream) that hands events to
   the event loop, and wait for the first event so engine refusals still get a proper status;
6. turn token ids into text (TextStream: incremental detokenization + stop strings) and either
   collect one JSON body or stream SSE chunks ending in ``data: [DONE]``.
Stopping early (stop string, client disconnect, shutdown) cancels the request: the worker thread
stops reading and calls ``close()`` on the engine's iterator after its next event.
"""
from __future__ import annotations

import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from tide import metrics
from tide.config import EngineConfig, ServerConfig
from tide.engine import openai_api as api
from tide.engine.base import Engine, GenerationRequest, SamplingParams, TokenEvent
from tide.engine.request_stream import Admission, EngineStream, engine_error
from tide.engine.text_stream import TextStream

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """A validated request on its way through the engine."""

    rid: str
    created: int
    chat: bool
    prompt_len: int
    stops: tuple[str, ...]
    include_usage: bool
    admitted: bool = False
    stream: EngineStream | None = None
    first: TokenEvent | None = None
    completion_tokens: int = 0
    steps: int = 0
    finish_reason: str | None = None


class _SSEResponse(StreamingResponse):
    """StreamingResponse that always runs ``on_close``, even when the body never started."""

    def __init__(self, content: AsyncIterator[str], on_close: Any, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _HttpMetrics:
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


def require_control_token(request: Request) -> None:
    """Dependency for /control/*: ``Authorization: Bearer <server.control_token>``, else 401.

    An empty configured token disables the control API (401 for everyone), so a default
    deployment exposes no operations.
    """
    expected: str = request.app.state.control_token
    if not expected:
        raise HTTPException(401, "control API disabled: set server.control_token",
                            headers={"WWW-Authenticate": "Bearer"})
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise HTTPException(401, "missing or wrong bearer token for the control API",
                            headers={"WWW-Authenticate": "Bearer"})


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class ControlPlane:
    """What a service mounts next to the engine's routes (the engine knows nothing of ops): a router
    served under the control token, and a health view added to /health as ``ops``."""

    router: APIRouter
    health: Callable[[], dict[str, Any]]


def build_app(engine: Engine, cfg: ServerConfig, engine_cfg: EngineConfig,
              ops: ControlPlane | None = None) -> FastAPI:
    """The FastAPI app over ``engine``; routes are listed in this module's docstring.

    ``ops`` (tide.ops.control_api.control_plane) adds the drafter control API under /control,
    behind the control token, and its state to /health.
    """
    app = FastAPI(title="TIDE engine", version="0.1.0")
    app.state.control_token = cfg.control_token
    app.state.engine = engine
    admission = Admission(cfg.max_inflight_requests)
    app.state.admission = admission
    limits = api.Limits(engine.max_seq_len, engine_cfg.max_prompt_tokens,
                        engine_cfg.max_new_tokens_limit, engine_cfg.default_max_new_tokens)
    tok = engine.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    stop_ids = (int(eos),) if isinstance(eos, int) else ()
    started_at = time.time()
    app.add_middleware(_HttpMetrics)

    @app.exception_handler(api.APIError)
    async def _api_error(_: Request, exc: api.APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "authentication_error" if exc.status_code == 401 else "invalid_request_error"
        return JSONResponse(api.error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(api.error_body(f"invalid request: {exc.errors()[:1]}",
                                           "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in request")
        return JSONResponse(api.error_body(f"internal error: {type(exc).__name__}: {exc}",
                                           "server_error"), status_code=500)

    async def read_body(request: Request, model: type) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cfg.max_body_bytes:
            raise api.APIError(413, f"request body of {declared} bytes exceeds {cfg.max_body_bytes}")
        raw = await request.body()
        if len(raw) > cfg.max_body_bytes:
            raise api.APIError(413, f"request body of {len(raw)} bytes exceeds {cfg.max_body_bytes}")
        req = api.parse_body(model, raw)
        if req.model not in (None, engine.target_model_id, engine.target_model_id.rsplit("/", 1)[-1]):
            raise api.APIError(404, f"model '{req.model}' is not served here; this engine serves "
                                    f"'{engine.target_model_id}'", "model_not_found", "model")
        return req

    def chat_prompt_ids(req: api.ChatCompletionRequest) -> list[int]:
        if not getattr(tok, "chat_template", None):
            raise api.APIError(400, "this model has no chat template; use /v1/completions")
        try:
            text = tok.apply_chat_template(req.template_messages(), add_generation_prompt=True,
                                           tokenize=False)
        except Exception as exc:  # noqa: BLE001 - templates raise on e.g. bad role order
            raise api.APIError(400, f"messages rejected by the chat template: {exc}", param="messages")
        return list(tok.encode(text, add_special_tokens=False))

    async def start(req: Any, chat: bool) -> _Job:
        """Tokenize, check limits, admit, submit, and wait for the first event."""
        t0 = time.perf_counter()
        if chat:
            ids = await run_in_threadpool(chat_prompt_ids, req)
        else:
            ids = list(await run_in_threadpool(tok.encode, req.prompt))
        if not ids:
            raise api.APIError(400, "prompt is empty after tokenization", param="prompt")
        max_new = api.check_limits(req, len(ids), limits)
        job = _Job(rid=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
                   chat=chat, prompt_len=len(ids), stops=req.stop_strings,
                   include_usage=req.include_usage_chunk)
        sampling = SamplingParams(max_new_tokens=max_new, temperature=req.temperature, top_p=req.top_p,
                                  seed=req.seed, stop_token_ids=stop_ids)
        admission.enter()
        job.admitted = True
        try:
            job.stream = EngineStream(engine, GenerationRequest(
                request_id=job.rid, prompt_ids=tuple(ids), sampling=sampling,
                workload=req.workload, capture=req.capture))
            try:
                job.first = await job.stream.next()
            except Exception as exc:  # noqa: BLE001
                raise engine_error(exc) from exc
            if job.first is None:
                raise api.APIError(500, "engine ended the request without output", "engine_error")
            metrics.HTTP_TTFT_SECONDS.observe(time.perf_counter() - t0)
            _raise_if_error_event(job.first)
        except BaseException:
            finish(job)
            raise
        return job

    def finish(job: _Job) -> None:
        """Release the admission slot once and cancel the engine request if it still runs."""
        if job.stream is not None:
            job.stream.cancel()
        if job.admitted:
            job.admitted = False
            admission.leave()

    async def pieces(job: _Job) -> AsyncIterator[str]:
        """Text deltas of the job; sets job.finish_reason; raises APIError on engine failure."""
        text = TextStream(tok, job.stops)
        event = job.first
        while event is not None:
            _raise_if_error_event(event)
            job.completion_tokens += len(event.token_ids)
            job.steps += 1
            delta = text.push(event.token_ids)
            if text.stopped:
                job.finish_reason = "stop"
            elif event.finished:
                job.finish_reason = event.finish_reason or "stop"
            if job.finish_reason:
                break
            if delta:
                yield delta
            try:
                event = await job.stream.next()
            except Exception as exc:  # noqa: BLE001
                raise engine_error(exc) from exc
        else:
            delta = ""
            job.finish_reason = "stop"  # iterator ended without a finished event
        delta += text.flush()
        if delta:
            yield delta

    def tide_info(job: _Job) -> dict[str, Any]:
        return api.tide_extension(engine.drafter_version, job.completion_tokens, job.steps)

    async def respond(req: Any, chat: bool) -> Response:
        job = await start(req, chat)
        model = engine.target_model_id
        if not req.stream:
            try:
                text = "".join([d async for d in pieces(job)])
            finally:
                finish(job)
            body = api.chat_body if chat else api.completion_body
            return JSONResponse(body(job.rid, job.created, model, text, job.finish_reason,
                                     api.usage(job.prompt_len, job.completion_tokens), tide_info(job)))

        def chunk(text: str | None, reason: str | None) -> str:
            if chat:
                delta = {"content": text} if text else {}
                return _sse(api.chat_chunk(job.rid, job.created, model, delta, reason))
            return _sse(api.completion_chunk(job.rid, job.created, model, text, reason))

        async def events() -> AsyncIterator[str]:
            try:
                if chat:
                    yield _sse(api.chat_chunk(job.rid, job.created, model,
                                              {"role": "assistant", "content": ""}, None))
                async for delta in pieces(job):
                    yield chunk(delta, None)
                yield chunk(None, job.finish_reason)
                if job.include_usage:
                    yield _sse(api.usage_chunk(job.rid, job.created, model,
                                               "chat.completion.chunk" if chat else "text_completion",
                                               api.usage(job.prompt_len, job.completion_tokens),
                                               tide_info(job)))
            except api.APIError as exc:  # headers are sent: report in-band, as OpenAI does
                log.warning("request %s failed mid-stream: %s", job.rid, exc.message)
                yield _sse(exc.body())
            finally:
                finish(job)
            yield "data: [DONE]\n\n"

        return _SSEResponse(events(), on_close=lambda: finish(job),
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                     "X-Request-Id": job.rid})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await respond(await read_body(request, api.CompletionRequest), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await respond(await read_body(request, api.ChatCompletionRequest), chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return api.models_body(engine.target_model_id, int(started_at))

    @app.get("/health")
    def health() -> JSONResponse:  # sync: engine.stats() may wait on the engine's lock
        try:
            st = engine.stats()
            body = {"status": "draining" if admission.draining else "ok",
                    "drafter_version": engine.drafter_version, "target_model": engine.target_model_id,
                    "max_seq_len": engine.max_seq_len, "max_batch_size": engine_cfg.max_batch_size,
                    "batch_size": REGISTRY.get_sample_value("tide_engine_batch_size"),
                    "queue_depth": REGISTRY.get_sample_value("tide_engine_queue_depth"),
                    "inflight_requests": admission.count, "max_inflight_requests": admission.limit,
                    "requests_finished": st.requests_finished, "requests_failed": st.requests_failed,
                    "tokens_generated": st.tokens_generated, "uptime_s": round(time.time() - started_at, 1)}
            body["engine"] = engine.health()
            if ops is not None:
                body["ops"] = ops.health()
        except Exception as exc:  # noqa: BLE001 - health must answer, not crash
            return JSONResponse({"status": "error", "error": f"{type(exc).__name__}: {exc}"}, 503)
        return JSONResponse(body, 503 if admission.draining else 200)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.post("/control/ping", dependencies=[Depends(require_control_token)])
    async def control_ping() -> dict[str, Any]:
        return {"ok": True, "drafter_version": engine.drafter_version}

    if ops is not None:
        app.include_router(ops.router, dependencies=[Depends(require_control_token)])

    return app


def _raise_if_error_event(event: TokenEvent) -> None:
    if event.error or event.finish_reason == "error":
        raise api.APIError(500, f"engine error: {event.error or 'unknown'}", "engine_error")


class HttpServer:
    """uvicorn in a background thread (so it installs no signal handlers of its own)."""

    def __init__(self, app: FastAPI, host: str, port: int, grace_s: float = 10.0,
                 log_level: str = "info") -> None:
        self.app = app
        self._server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="off", access_log=False,
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


def serve(app: FastAPI, host: str, port: int, stop_event: threading.Event, grace_s: float = 10.0) -> None:
    """Serve until ``stop_event`` is set (e.g. by a SIGTERM handler), then drain and return."""
    server = HttpServer(app, host, port, grace_s)
    bound = server.start()
    log.info("serving on http://%s:%d", host, bound)
    try:
        while not stop_event.wait(0.5):
            if not server.alive:
                raise RuntimeError("HTTP server stopped unexpectedly")
    finally:
        server.stop(timeout_s=grace_s + 5)
