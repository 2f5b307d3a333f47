"""Where a running request's committed tokens go, for the reference engine's decode thread.

``RequestOutputs`` holds the running requests by cache slot and hands each step's tokens out:
1. to the caller, up to a stop token, the request's token budget or the context limit
   (``deliverable`` decides how many of a step's committed tokens go out, and why it ends there);
2. to the capture sink, once per step (enqueue only; a raising sink never fails a request),
   and an end marker when the request is released;
3. to the accounting: tokens per drafter version, the request's outcome.
Everything here runs on the decode thread; callers only read ``running``'s size.
"""
from __future__ import annotations

import logging
import queue

import torch

from tide.engine.accounting import EngineAccounting
from tide.engine.base import CaptureSink, StepCapture, TokenEvent
from tide.engine.running import Running

log = logging.getLogger(__name__)


class RequestOutputs:
    def __init__(self, acct: EngineAccounting, eos_ids: tuple[int, ...], max_seq_len: int, hidden_size: int):
        self.running: dict[int, Running] = {}  # cache slot -> request
        self.sink: CaptureSink | None = None
        self.acct, self.eos_ids, self.max_seq_len, self.hidden_size = acct, eos_ids, max_seq_len, hidden_size

    def deliverable(self, r: Running, tokens: list[int]) -> tuple[int, str | None]:
        """How many of ``tokens`` go to the caller, and why the request ends there (None: it goes on)."""
        sp = r.req.sampling
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_ids))
        for i, t in enumerate(tokens):
            if t in stops:
                return i + 1, "stop"
            if r.generated + i + 1 >= sp.max_new_tokens:
                return i + 1, "length"
        return len(tokens), None

    def emit(self, slot: int, tokens: list[int], version: str) -> int:
        """Hand ``tokens`` to the caller up to a stop or the budget; returns how many went out."""
        r = self.running[slot]
        n, reason = self.deliverable(r, tokens)
        out = tokens[:n]
        r.generated += n
        if reason is None and r.row.t_len + 1 >= self.max_seq_len:
            reason = "length"
        self.acct.tokens(version, len(out))
        if reason is None:
            r.out.put(TokenEvent(tuple(out)))
        else:
            self.release(slot, reason)  # capture's end marker goes out before the caller sees the end
            r.out.put(TokenEvent(tuple(out), True, reason))
        return len(out)

    def finish(self, slot: int, reason: str, error: str | None = None) -> None:
        r = self.running.get(slot)
        if r is None:
            return
        self.release(slot, reason)
        r.out.put(TokenEvent((), True, reason, error))

    def release(self, slot: int, reason: str) -> None:
        r = self.running.pop(slot)
        if self.sink is not None and r.req.capture:
            self.offer([StepCapture(r.meta, r.row.t_len, torch.empty(0, dtype=torch.long),
                                    torch.empty(0, r.hist_aux[0].shape[-1]), torch.empty(0, self.hidden_size),
                                    False, True)])
        self.acct.outcome("ok" if reason in ("stop", "length") else reason)

    def offer(self, caps: list[StepCapture]) -> None:
        sink = self.sink
        if sink is None or not caps:
            return
        try:
            sink.offer(caps)
        except Exception:  # the sink must not raise; if it does, inference goes on
            log.exception("capture sink raised")

    def fail_all(self, inbox: "queue.Queue[Running]", error: str) -> None:
        """End every running and queued request with ``error`` (the decode loop is gone)."""
        for slot in list(self.running):
            self.finish(slot, "error", error=error)
        while True:
            try:
                waiting = inbox.get_nowait()
            except queue.Empty:
                return
            waiting.out.put(TokenEvent((), True, "error", error))
            self.acct.outcome("error")
