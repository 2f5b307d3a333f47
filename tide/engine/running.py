"""One running request of the reference engine: its state, its caller's event iterator, and the
drafter feed built from its history (what the drafter consumes on the request's next drafted step).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch

from tide.contracts import GREEDY_TEMPERATURE
from tide.engine.base import CaptureMeta, GenerationRequest, TokenEvent
from tide.spec.decode import RowInput

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
