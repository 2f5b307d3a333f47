"""Batches for the training loop: today's in-line collate on CPU, a prefetching worker on a GPU.

On a GPU the host must stay ahead of the device: a background thread collates the next batches
(padding, the bf16 -> fp32 copy of the target states) into pinned memory while the GPU runs the
current step, and the copy to the device is asynchronous. On the CPU the same thread only
competes with the training step for the cores (a retrain measured 7-11% slower with it), so the
CPU path is the plain loop.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Callable, Iterator

import torch

from tide.train.objective import Batch

PREFETCH_BATCHES = 3
_DONE = object()


def to_device(batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
    moved = {f.name: None if getattr(batch, f.name) is None else
             getattr(batch, f.name).to(device, non_blocking=non_blocking) for f in dataclasses.fields(batch)}
    return Batch(**moved)


def _pinned(batch: Batch) -> Batch:
    return Batch(**{f.name: None if getattr(batch, f.name) is None else getattr(batch, f.name).pin_memory()
                    for f in dataclasses.fields(batch)})


def batch_stream(make: Callable[[int], Batch], indices: list[int], device: torch.device) -> Iterator[Batch]:
    """``make(i)`` for each index, on ``device``; prefetched by a worker thread unless on the CPU."""
    if device.type == "cpu":
        for i in indices:
            yield make(i)
        return
    ready: queue.Queue = queue.Queue(maxsize=PREFETCH_BATCHES)
    stop = threading.Event()

    def work() -> None:
        try:
            for i in indices:
                if stop.is_set():
                    return
                ready.put(_pinned(make(i)))
            ready.put(_DONE)
        except BaseException as exc:  # re-raised in the training thread
            ready.put(exc)

    worker = threading.Thread(target=work, name="tide-batches", daemon=True)
    worker.start()
    try:
        while (item := ready.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield to_device(item, device, non_blocking=True)
    finally:
        stop.set()
        while worker.is_alive():  # unblock a worker waiting on a full queue
            try:
                ready.get_nowait()
            except queue.Empty:
                worker.join(0.05)
