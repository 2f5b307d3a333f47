"""Accumulates one request's step captures and turns them into a ``Record``.

Runs only in the producer thread (never on the engine's hot path). Steps:
1. ``add`` keeps references to the step's tensors, checking positions are contiguous (a gap means
   a step was dropped upstream: the request is abandoned, since a record with a hole would teach
   the drafter wrong transitions);
2. the request is ready when a step says ``finished`` or ``max_tokens`` positions are held
   (then it is truncated to exactly ``max_tokens`` and later steps are ignored);
3. ``build`` concatenates, casts to the storage dtype (bfloat16 or float8_e4m3fn) on the CPU and
   fills the record; loss mask 0 on prompt positions, 1 on generated ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tide.contracts import HIDDEN_ITEMSIZE
from tide.engine.base import CaptureMeta, StepCapture
from tide.records import Record, hidden_bytes


class GapError(ValueError):
    """A step does not start where the previous one ended."""


@dataclass
class PendingRequest:
    meta: CaptureMeta
    steps: list[StepCapture] = field(default_factory=list)
    tokens: int = 0
    next_position: int = -1
    last_step_at_s: float = 0.0
    complete: bool = False  # finished, or truncated at max_tokens

    def add(self, step: StepCapture, max_tokens: int, now_s: float) -> None:
        n = int(step.token_ids.shape[0])
        if self.next_position >= 0 and n and step.start_position != self.next_position:
            raise GapError(f"request {self.meta.request_id}: step starts at {step.start_position}, "
                           f"expected {self.next_position}")
        self.last_step_at_s = now_s
        if n:
            if self.next_position < 0:
                self.next_position = step.start_position
            self.steps.append(step)
            self.tokens += n
            self.next_position += n
        if step.finished or self.tokens >= max_tokens:
            self.complete = True


def build_record(pending: PendingRequest, hidden_dtype: str, max_tokens: int,
                 finished_at_s: float | None = None) -> Record:
    """Concatenate the held steps (at most ``max_tokens`` positions) into one record."""
    if hidden_dtype not in HIDDEN_ITEMSIZE:
        raise ValueError(f"hidden_dtype {hidden_dtype!r} not in {sorted(HIDDEN_ITEMSIZE)}")
    steps = pending.steps
    meta = pending.meta
    token_ids = torch.cat([s.token_ids.detach().reshape(-1).cpu() for s in steps])[:max_tokens]
    mask = torch.cat([torch.full((int(s.token_ids.shape[0]),), 0 if s.is_prompt else 1,
                                 dtype=torch.uint8) for s in steps])[:max_tokens]
    aux = torch.cat([s.aux_hidden.detach() for s in steps])[:max_tokens]
    final = torch.cat([s.final_hidden.detach() for s in steps])[:max_tokens]
    hidden_size = int(final.shape[-1])
    if aux.shape[-1] != 3 * hidden_size or aux.shape[0] != final.shape[0]:
        raise ValueError(f"aux_hidden {tuple(aux.shape)} does not match final_hidden "
                         f"{tuple(final.shape)} (expected [T, 3H] and [T, H])")
    return Record(
        request_id=meta.request_id, target_model_id=meta.target_model_id,
        drafter_version=meta.drafter_version, aux_layer_ids=tuple(meta.aux_layer_ids),
        workload=meta.workload, started_at_s=float(meta.started_at_s),
        finished_at_s=time.time() if finished_at_s is None else finished_at_s,
        hidden_size=hidden_size, hidden_dtype=hidden_dtype,
        token_ids=token_ids.numpy().astype(np.int32), loss_mask=mask.numpy(),
        aux_hidden=hidden_bytes(aux, hidden_dtype), final_hidden=hidden_bytes(final, hidden_dtype),
        position_start=steps[0].start_position, request_num_tokens=int(token_ids.shape[0]))
