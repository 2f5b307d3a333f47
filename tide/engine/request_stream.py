"""One request's path from the event loop to the engine's blocking iterator, and admission.

Why a thread per request rather than the shared threadpool: ``Engine.submit`` returns a blocking
iterator that may block for a request's whole generation; a bounded pool would let a few long
requests starve health checks and tokenization. Admission bounds the number of such threads.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from tide import metrics
from tide.engine import openai_api as api
from tide.engine.base import Engine, GenerationRequest, TokenEvent

log = logging.getLogger(__name__)
_END = object()


@dataclass(frozen=True)
class _Failure:
    exc: BaseException


class EngineStream:
    """One request's engine iterator, driven by its own thread, read from the event loop.

    Steps (thread): ``engine.submit``; forward each TokenEvent via ``call_soon_threadsafe``; stop
    after a finished event or once ``cancel()`` was called; ``close()`` the iterator (how a
    generator-based engine learns the reader left); post an end marker. Exceptions are forwarded
    and re-raised by ``next()``. A thread per request, not the shared threadpool, because a
    request may block for its whole generation.
    """

    def __init__(self, engine: Engine, request: GenerationRequest) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._cancel = threading.Event()
        self._ended = False
        self._it: Any = None
        threading.Thread(target=self._run, args=(engine, request), daemon=True,
                         name=f"tide-http-{request.request_id[-8:]}").start()

    def cancel(self) -> None:
        """Stop reading; also wake the engine's iterator if it offers a thread-safe ``cancel()``
        (the reference engine's does), so a request still queued is dropped before its prefill."""
        self._cancel.set()
        self._wake()

    def _wake(self) -> None:
        wake = getattr(self._it, "cancel", None)
        if callable(wake):
            try:
                wake()
            except Exception:  # noqa: BLE001 - cancelling is best effort; close() still follows
                log.exception("cancelling an engine iterator failed")

    def _post(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # event loop closed: nobody is listening any more
            self._cancel.set()

    def _run(self, engine: Engine, request: GenerationRequest) -> None:
        it = None
        try:
            it = self._it = engine.submit(request)
            if self._cancel.is_set():  # cancelled while submit ran
                self._wake()
            for event in it:
                self._post(event)
                if event.finished or self._cancel.is_set():
                    break
        except BaseException as exc:  # noqa: BLE001 - forwarded to the request, never lost
            self._post(_Failure(exc))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001
                    log.exception("closing the engine stream of %s failed", request.request_id)
            self._post(_END)

    async def next(self) -> TokenEvent | None:
        """The next event; None when the engine's iterator ended."""
        if self._ended:
            return None
        item = await self._queue.get()
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, _Failure):
            self._ended = True
            raise item.exc
        return item


def engine_error(exc: BaseException, rid: str, retry_after_s: int) -> api.APIError:
    """The status for an exception from the engine; a 500's text goes to the log, not the client."""
    if isinstance(exc, ValueError):
        return api.APIError(400, f"engine refused the request: {exc}")
    if isinstance(exc, (queue.Full, TimeoutError, ConnectionError)):
        log.warning("request %s: engine unavailable: %s", rid, exc)
        return api.APIError(503, "engine unavailable; retry later", "engine_unavailable",
                            headers={"Retry-After": str(retry_after_s)})
    log.error("request %s failed in the engine", rid, exc_info=exc)
    return api.APIError(500, f"engine error in request {rid}; details are in the server log", "engine_error")


class Admission:
    """Counts generation requests in flight; refuses beyond the limit or while draining (503 with
    Retry-After, which the openai client and most load tools honour)."""

    def __init__(self, limit: int, retry_after_s: int = 1) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.count = 0
        self.draining = False

    def enter(self) -> None:
        retry = {"Retry-After": str(self.retry_after_s)}
        if self.draining:
            raise api.APIError(503, "server is shutting down", "server_unavailable", headers=retry)
        if self.count >= self.limit:
            raise api.APIError(503, f"server busy: {self.count} requests in flight (limit {self.limit})",
                               "server_overloaded", headers=retry)
        self.count += 1
        metrics.HTTP_INFLIGHT.set(self.count)

    def leave(self) -> None:
        self.count -= 1
        metrics.HTTP_INFLIGHT.set(self.count)
