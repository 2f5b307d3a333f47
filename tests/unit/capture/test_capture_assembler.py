"""Assembling a request's steps into a record: positions, masks, truncation, dtype casts."""
import time

import numpy as np
import pytest
import torch

from tide.capture.assembler import GapError, PendingRequest, build_record
from tide.capture.tap import stage
from tide.contracts import CaptureMeta, StepCapture
from tide.records import decode, encode, hidden_to_float32

torch.set_num_threads(1)
H = 8


def meta(rid="r1"):
    return CaptureMeta(rid, "m", "v1", (1, 2, 3), "chat", 4, time.time())


def add(pending, s, max_tokens, now_s, dtype="bfloat16"):
    """As the worker gets it: rows cast and staged by the engine's tap."""
    pending.add(stage(s, dtype), max_tokens, now_s)


def step(m, start, n, prompt=False, finished=False):
    return StepCapture(m, start, torch.arange(start, start + n), torch.randn(n, 3 * H),
                       torch.randn(n, H), prompt, finished)


def test_record_holds_every_position_in_order_with_loss_mask():
    m = meta()
    steps = [step(m, 0, 4, prompt=True), step(m, 4, 2), step(m, 6, 3), step(m, 9, 0, finished=True)]
    pending = PendingRequest(m)
    for s in steps:
        add(pending, s, 100, 0.0)
    assert pending.complete
    rec = decode(encode(build_record(pending, "bfloat16", 100)))
    assert rec.token_ids.tolist() == list(range(9))
    assert rec.loss_mask.tolist() == [0] * 4 + [1] * 5
    aux = torch.cat([s.aux_hidden for s in steps])
    got = torch.from_numpy(hidden_to_float32(rec.aux_hidden, "bfloat16", 3 * H))
    assert torch.equal(got, aux.bfloat16().float())
    assert (rec.drafter_version, rec.workload, rec.aux_layer_ids) == ("v1", "chat", (1, 2, 3))


def test_gap_is_detected():
    m = meta()
    pending = PendingRequest(m)
    add(pending, step(m, 0, 4, prompt=True), 100, 0.0)
    with pytest.raises(GapError):
        add(pending, step(m, 6, 1), 100, 0.0)


def test_truncates_at_max_tokens():
    m = meta()
    pending = PendingRequest(m)
    add(pending, step(m, 0, 4, prompt=True), 6, 0.0)
    assert not pending.complete
    add(pending, step(m, 4, 3), 6, 0.0)
    assert pending.complete
    rec = build_record(pending, "bfloat16", 6)
    assert rec.num_tokens == 6 and rec.token_ids.tolist() == list(range(6))
    assert len(rec.final_hidden) == 6 * H * 2


def test_fp8_storage_matches_torch_cast():
    m = meta()
    pending = PendingRequest(m)
    s = step(m, 0, 5, prompt=True, finished=True)
    add(pending, s, 100, 0.0, "float8_e4m3fn")
    rec = build_record(pending, "float8_e4m3fn", 100)
    got = hidden_to_float32(rec.final_hidden, "float8_e4m3fn", H)
    assert np.array_equal(got, s.final_hidden.to(torch.float8_e4m3fn).float().numpy())


def test_mismatched_shapes_are_refused():
    m = meta()
    pending = PendingRequest(m)
    add(pending, StepCapture(m, 0, torch.arange(3), torch.randn(3, 2 * H), torch.randn(3, H), True,
                            True), 100, 0.0)
    with pytest.raises(ValueError, match=r"\[T, 3H\]"):
        build_record(pending, "bfloat16", 100)
