"""Accumulates one request's staged steps and turns them into a ``Record``.

Runs only in the capture worker process (numpy only: it never imports torch). Steps:
1. ``add`` keeps the step's arrays, checking positions are contiguous (a gap means a step was
   dropped upstream: the request is abandoned, since a record with a hole would teach the drafter
   wrong transitions);
   a step whose drafter version differs from the one before starts a version change (a swap
   while the request ran: its later positions were drafted under the new version);
2. the request is ready when a step says ``finished`` or ``max_tokens`` positions are held
   (then it is truncated to exactly ``max_tokens`` and later steps are ignored);
3. ``build`` concatenates the rows (already raw storage-dtype bytes: the engine's tap cast them
   while staging) and fills the record; loss mask 0 on prompt positions, 1 on generated ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from tide.contracts import HIDDEN_ITEMSIZE, CaptureMeta
from tide.records import Record


class GapError(ValueError):
    """A step does not start where the previous one ended."""


@dataclass
class StagedStep:
    """One request's committed positions of one step, as raw storage-dtype rows."""

    meta: CaptureMeta
    start_position: int
    token_ids: np.ndarray  # int32 [n]
    aux_hidden: np.ndarray  # uint8 [n, 3H * itemsize]
    final_hidden: np.ndarray  # uint8 [n, H * itemsize]
    is_prompt: bool
    finished: bool = False


@dataclass
class PendingRequest:
    meta: CaptureMeta
    steps: list[StagedStep] = field(default_factory=list)
    # (first position, drafter version) for every swap the request spanned, in position order
    version_changes: list[tuple[int, str]] = field(default_factory=list)
    tokens: int = 0
    next_position: int = -1
    last_step_at_s: float = 0.0
    complete: bool = False  # finished, or truncated at max_tokens

    def add(self, step: StagedStep, max_tokens: int, now_s: float) -> None:
        n = int(step.token_ids.shape[0])
        if self.next_position >= 0 and n and step.start_position != self.next_position:
            raise GapError(f"request {self.meta.request_id}: step starts at {step.start_position}, "
                           f"expected {self.next_position}")
        self.last_step_at_s = now_s
        if n:
            if self.next_position < 0:
                self.next_position = step.start_position
            current = self.version_changes[-1][1] if self.version_changes else self.meta.drafter_version
            if step.meta.drafter_version != current:
                self.version_changes.append((step.start_position, step.meta.drafter_version))
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
    steps, meta, item = pending.steps, pending.meta, HIDDEN_ITEMSIZE[hidden_dtype]
    end = steps[0].start_position + max_tokens
    token_ids = np.concatenate([s.token_ids.reshape(-1) for s in steps])[:max_tokens].astype(np.int32)
    mask = np.concatenate([np.full(int(s.token_ids.shape[0]), 0 if s.is_prompt else 1, dtype=np.uint8)
                           for s in steps])[:max_tokens]
    aux = np.concatenate([s.aux_hidden for s in steps])[:max_tokens]
    final = np.concatenate([s.final_hidden for s in steps])[:max_tokens]
    if final.shape[-1] % item or aux.shape[-1] != 3 * final.shape[-1] or aux.shape[0] != final.shape[0] \
            or aux.shape[0] != token_ids.shape[0]:
        raise ValueError(f"aux_hidden {tuple(aux.shape)} does not match final_hidden "
                         f"{tuple(final.shape)} (expected [T, 3H] and [T, H] rows of {hidden_dtype})")
    return Record(
        request_id=meta.request_id, target_model_id=meta.target_model_id,
        drafter_version=meta.drafter_version, aux_layer_ids=tuple(meta.aux_layer_ids),
        workload=meta.workload, started_at_s=float(meta.started_at_s),
        finished_at_s=time.time() if finished_at_s is None else finished_at_s,
        hidden_size=final.shape[-1] // item, hidden_dtype=hidden_dtype,
        token_ids=token_ids, loss_mask=mask,
        aux_hidden=aux.tobytes(), final_hidden=final.tobytes(),
        position_start=steps[0].start_position, request_num_tokens=int(token_ids.shape[0]),
        version_changes=tuple((p, v) for p, v in pending.version_changes if p < end))
