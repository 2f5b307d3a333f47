"""One generation request's path through the engine, for the HTTP routes in server.py.

Steps:
1. tokenize the prompt (or render the chat template), in a worker thread; token-id prompts are
   range-checked instead;
2. check prompt length and max tokens against the engine's context and EngineConfig limits;
3. admit it if fewer than ``max_inflight_requests`` are being served (else 503);
4. run the engine's blocking iterator in a dedicated thread (EngineStream) and wait for the first
   event, so engine refusals still get a proper status;
5. turn token ids into text (TextStream: incremental detokenization + stop strings) and either
   collect one body or stream SSE chunks ending in ``data: [DONE]``.
Stopping early (stop string, client disconnect, shutdown) cancels the request. Until the response
starts, :func:`unless_client_leaves` watches the connection: a client that leaves while its
request is queued or generating cancels it (a queued one is never prefilled).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from tide import metrics
from tide.engine import openai_api as api
from tide.engine import openai_responses as responses
from tide.engine.base import Engine, GenerationRequest, SamplingParams, TokenEvent
from tide.engine.request_stream import Admission, EngineStream, engine_error
from tide.engine.text_stream import TextStream

log = logging.getLogger(__name__)
T = TypeVar("T")
TOKENIZE_THREADS = 4


class ClientGone(Exception):
    """The client disconnected before its response started; nobody is left to answer."""


async def unless_client_leaves(receive: Callable[[], Awaitable[Any]], work: Awaitable[T]) -> T:
    """``await work``, cancelling it and raising ClientGone if the client disconnects first.

    Only valid once the request body has been read: from then on the ASGI server's receive()
    returns nothing but ``http.disconnect``.
    """
    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its cleanup (cancel, release) runs now
    if task.cancelled():
        raise ClientGone()
    return task.result()


@dataclass
class Job:
    """A validated request on its way through the engine."""

    rid: str
    created: int
    chat: bool
    prompt_len: int
    stops: tuple[str, ...]
    include_usage: bool
    usage_on_every_chunk: bool = False
    admitted: bool = False
    stream: EngineStream | None = None
    first: TokenEvent | None = None
    completion_tokens: int = 0
    steps: int = 0
    finish_reason: str | None = None


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def raise_if_error_event(event: TokenEvent, rid: str) -> None:
    if event.error or event.finish_reason == "error":
        # the engine's text can name internals (paths, tensors): it goes to the log only
        log.error("request %s failed in the engine: %s", rid, event.error or "unknown")
        raise api.APIError(500, f"engine error in request {rid}; details are in the server log",
                           "engine_error")


class Generations:
    """Starts, streams and finishes jobs on one engine."""

    def __init__(self, engine: Engine, limits: api.Limits, admission: Admission) -> None:
        self.engine = engine
        self.limits = limits
        self.admission = admission
        self.tok = engine.tokenizer
        # tokenization gets its own threads: in the shared pool a flood of long prompts would
        # queue /health and /metrics (sync routes) behind it
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tide-tokenize")
        self.vocab_size = len(self.tok)
        eos = getattr(self.tok, "eos_token_id", None)
        self.eos_ids = (int(eos),) if isinstance(eos, int) else ()

    def close(self) -> None:
        """Drop tokenizations still queued (the server stopped; nobody waits for them)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def prompt_ids(self, req: Any, chat: bool) -> list[int]:
        """The prompt's token ids (blocking: run it in a worker thread)."""
        if not chat:
            if isinstance(req.prompt, str):
                return list(self.tok.encode(req.prompt))
            api.check_token_ids(req.prompt, self.vocab_size, "prompt")
            return list(req.prompt)
        if not getattr(self.tok, "chat_template", None):
            raise api.APIError(400, "this model has no chat template; use /v1/completions")
        try:
            text = self.tok.apply_chat_template(req.template_messages(), add_generation_prompt=True,
                                                tokenize=False)
        except Exception as exc:  # noqa: BLE001 - templates raise on e.g. bad role order
            raise api.APIError(400, f"messages rejected by the chat template: {exc}", param="messages")
        return list(self.tok.encode(text, add_special_tokens=False))

    def sampling(self, req: Any, max_new: int) -> SamplingParams:
        api.check_token_ids(req.stop_ids, self.vocab_size, "stop")
        stop_ids = req.stop_ids + (() if req.ignore_eos else self.eos_ids)
        return SamplingParams(max_new_tokens=max_new, temperature=req.greedy_temperature,
                              top_p=req.top_p, seed=req.seed, stop_token_ids=tuple(dict.fromkeys(stop_ids)),
                              top_k=max(0, req.top_k), ignore_eos=req.ignore_eos)

    async def start(self, req: Any, chat: bool) -> Job:
        """Tokenize, check limits, admit, submit, and wait for the first event."""
        t0 = time.perf_counter()
        ids = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, self.prompt_ids, req, chat)
        if not ids:
            raise api.APIError(400, "prompt is empty after tokenization", param="prompt")
        max_new = api.check_limits(req, len(ids), self.limits)
        sampling = self.sampling(req, max_new)
        job = Job(rid=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
                  chat=chat, prompt_len=len(ids), stops=req.stop_strings, include_usage=req.include_usage_chunk,
                  usage_on_every_chunk=req.usage_on_every_chunk)
        self.admission.enter()
        job.admitted = True
        try:
            job.stream = EngineStream(self.engine, GenerationRequest(
                request_id=job.rid, prompt_ids=tuple(ids), sampling=sampling,
                workload=req.workload, capture=req.capture))
            try:
                job.first = await job.stream.next()
            except Exception as exc:  # noqa: BLE001
                raise engine_error(exc, job.rid, self.admission.retry_after_s) from exc
            if job.first is None:
                raise api.APIError(500, "engine ended the request without output", "engine_error")
            metrics.HTTP_TTFT_SECONDS.observe(time.perf_counter() - t0)
            raise_if_error_event(job.first, job.rid)
        except BaseException:
            self.finish(job)
            raise
        return job

    def finish(self, job: Job) -> None:
        """Release the admission slot once and cancel the engine request if it still runs."""
        if job.stream is not None:
            job.stream.cancel()
        if job.admitted:
            job.admitted = False
            self.admission.leave()

    async def pieces(self, job: Job) -> AsyncIterator[str]:
        """Text deltas of the job; sets job.finish_reason; raises APIError on engine failure."""
        text = TextStream(self.tok, job.stops)
        event = job.first
        while event is not None:
            raise_if_error_event(event, job.rid)
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
                raise engine_error(exc, job.rid, self.admission.retry_after_s) from exc
        else:
            delta = ""
            job.finish_reason = "stop"  # iterator ended without a finished event
        delta += text.flush()
        if delta:
            yield delta

    async def collect(self, job: Job) -> str:
        try:
            return "".join([d async for d in self.pieces(job)])
        finally:
            self.finish(job)

    def tide_info(self, job: Job) -> dict[str, Any]:
        return responses.tide_extension(self.engine.drafter_version, job.completion_tokens, job.steps)

    def body(self, job: Job, text: str) -> dict[str, Any]:
        make = responses.chat_body if job.chat else responses.completion_body
        return make(job.rid, job.created, self.engine.target_model_id, text, job.finish_reason,
                    responses.usage(job.prompt_len, job.completion_tokens), self.tide_info(job))

    async def events(self, job: Job) -> AsyncIterator[str]:
        """SSE chunks of a streamed job, ending in ``data: [DONE]``."""
        model, chat = self.engine.target_model_id, job.chat

        def chunk(text: str | None, reason: str | None) -> str:
            if chat:
                obj = responses.chat_chunk(job.rid, job.created, model, {"content": text} if text else {}, reason)
            else:
                obj = responses.completion_chunk(job.rid, job.created, model, text, reason)
            if job.usage_on_every_chunk:
                obj["usage"] = responses.usage(job.prompt_len, job.completion_tokens)
            return sse(obj)

        try:
            if chat:
                yield sse(responses.chat_chunk(job.rid, job.created, model, {"role": "assistant", "content": ""}, None))
            async for delta in self.pieces(job):
                yield chunk(delta, None)
            yield chunk(None, job.finish_reason)
            if job.include_usage:
                yield sse(responses.usage_chunk(job.rid, job.created, model,
                                                "chat.completion.chunk" if chat else "text_completion",
                                                responses.usage(job.prompt_len, job.completion_tokens),
                                                self.tide_info(job)))
        except api.APIError as exc:  # headers are sent: report in-band, as OpenAI does
            log.warning("request %s failed mid-stream: %s", job.rid, exc.message)
            yield sse(exc.body())
        finally:
            self.finish(job)
        yield "data: [DONE]\n\n"
