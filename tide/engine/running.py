"""One running request of the reference engine: its state, its caller's event iterator, and the
drafter feed built from its history (what the drafter consumes on the request's next drafted step).
"""
from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass, field

import torch

from tide.contracts import GREEDY_TEMPERATURE
from tide.engine.base import CaptureMeta, GenerationRequest, StepCapture, TokenEvent
from tide.spec.decode import RowInput, RowResult

DONE = object()  # queued by Events.cancel to wake a reader blocked on the next event


@dataclass
class Running:
    req: GenerationRequest
    out: "queue.Queue[TokenEvent]"
    row: RowInput
    meta: CaptureMeta
    hist_tokens: list[int]  # every token fed to the target, then the pending one
    hist_aux: list[torch.Tensor] = field(default_factory=list)  # aux states of fed positions
    generated: int = 0
    refeed: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)


def check_request(request: GenerationRequest, max_seq_len: int) -> None:
    """ValueError for a request the engine cannot serve (the server answers 400)."""
    total = len(request.prompt_ids) + request.sampling.max_new_tokens
    if not request.prompt_ids or total > max_seq_len:
        raise ValueError(f"prompt ({len(request.prompt_ids)}) + max_new_tokens "
                         f"({request.sampling.max_new_tokens}) must be in 1..{max_seq_len}")
    sp = request.sampling
    if not (math.isfinite(sp.temperature) and math.isfinite(sp.top_p)):  # would reach sampling as NaN
        raise ValueError(f"temperature and top_p must be finite, got {sp.temperature}, {sp.top_p}")


def new_running(request: GenerationRequest, meta: CaptureMeta) -> Running:
    """A submitted request's state before its prefill (its slot and lengths are set at admission)."""
    sp = request.sampling
    gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
    # below GREEDY_TEMPERATURE logits / temperature overflows; the distribution is one-hot anyway
    temperature = sp.temperature if sp.temperature >= GREEDY_TEMPERATURE else 0.0
    row = RowInput(slot=-1, t_len=0, pending=-1, feed_start=0, feed_tokens=torch.empty(0),
                   feed_aux=torch.empty(0), temperature=temperature, top_p=sp.top_p, generator=gen,
                   top_k=sp.top_k)
    return Running(req=request, out=queue.Queue(), row=row, meta=meta, hist_tokens=list(request.prompt_ids))


class Events:
    """A caller's iterator over one request's TokenEvents.

    ``close()`` (reader done) and ``cancel()`` (thread-safe, from anywhere) mark the request
    cancelled: the decode loop drops it at its next step, or before its prefill while it waits
    in the inbox. ``cancel()`` also wakes a reader blocked waiting for the next event.
    """

    def __init__(self, running: Running) -> None:
        self._r = running
        self._done = False

    def __iter__(self) -> "Events":
        return self

    def __next__(self) -> TokenEvent:
        if self._done:
            raise StopIteration
        ev = self._r.out.get()
        if ev is DONE:
            self.close()
            raise StopIteration
        if ev.finished:
            self.close()
        return ev

    def cancel(self) -> None:
        self._r.cancelled.set()
        self._r.out.put(DONE)

    def close(self) -> None:
        self._done = True
        self._r.cancelled.set()


def build_feed(r: Running) -> None:
    """Set the row's drafter feed: the positions since ``feed_start`` (tokens shifted by one)."""
    row = r.row
    row.feed_tokens = torch.tensor(r.hist_tokens[row.feed_start + 1: row.t_len + 1])
    if r.refeed or len(r.hist_aux) == 1:  # after prefill, a swap or target-only steps
        need, tail = row.t_len - row.feed_start, []
        for chunk in reversed(r.hist_aux):  # the last ``need`` positions only, not the whole history
            tail.append(chunk)
            need -= chunk.shape[0]
            if need <= 0:
                break
        row.feed_aux = torch.cat(tail[::-1])[-(row.t_len - row.feed_start):]
        r.refeed = False
    else:
        row.feed_aux = r.hist_aux[-1]


def defer_feed(r: Running, refeed_positions: int) -> None:
    """Keep a row's drafter feed for its next drafted step (refeed from ``feed_start``); past
    ``refeed_positions`` of backlog the drafter attends from the recent positions only, as after
    a swap (lossless either way: drafts are verified)."""
    r.refeed = True
    if r.row.t_len + 1 - r.row.feed_start > refeed_positions:
        r.row.feed_start = r.row.drafter_first_pos = r.row.t_len + 1 - refeed_positions


def captured(r: Running, res: RowResult, sent: int) -> StepCapture:
    """What capture gets of a step: only the positions fed with the ``sent`` tokens that reached the
    caller (the pending token and the accepted drafts before a stop or the budget), so a request's
    captured positions are its prompt plus its output less one."""
    return StepCapture(r.meta, r.row.t_len, res.fed_tokens[:sent], res.aux_hidden[:sent],
                       res.final_hidden[:sent], is_prompt=False)


def advance(r: Running, res: RowResult, drafter_ran: bool, refeed_positions: int) -> None:
    """A step's committed tokens and target states into the request's history and row."""
    r.hist_aux.append(res.aux_hidden)
    r.hist_tokens.extend(res.committed)
    if drafter_ran:
        r.row.feed_start = r.row.t_len
    else:
        defer_feed(r, refeed_positions)  # the drafter did not run: it consumes these positions later
    r.row.t_len += len(res.committed)
    r.row.pending = res.committed[-1]
