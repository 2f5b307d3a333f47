"""A confidence head serves only with a recorded held-out ECE within the bar: the ECE travels in the
head's own file, and an engine given a head that fails it ranks drafts on the top-probability chain
instead, saying so in health, the log and tide_engine_confidence_head."""
import copy
import hashlib
import json
import logging

import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import load_file, save_file

from tide.drafter.artifact import DrafterError, load_drafter, save_drafter
from tide.drafter.confidence import MAX_HEAD_ECE, Confidence, serving_head
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine


def _with_head(drafter, ece):
    d = copy.deepcopy(drafter)
    d.confidence = Confidence(torch.zeros(2 * d.shape.hidden_size + 1), 0.5, torch.ones(3), heldout_ece=ece)
    return d


def test_the_held_out_ece_travels_in_the_head_file_and_a_garbled_one_is_refused(tmp_path, tiny_drafter):
    folder = save_drafter(_with_head(tiny_drafter, 0.031), tmp_path / "d")
    assert load_drafter(folder, require_checksum=True).confidence.heldout_ece == pytest.approx(0.031)
    assert load_drafter(save_drafter(_with_head(tiny_drafter, None), tmp_path / "n")).confidence.heldout_ece is None
    head = folder / "confidence" / "head.safetensors"
    save_file(load_file(str(head)), str(head), metadata={"heldout_ece": "abc"})
    meta = json.loads((folder / "tide.json").read_text())
    meta["confidence_sha256"] = hashlib.sha256(head.read_bytes()).hexdigest()  # a consistent, garbled artifact
    (folder / "tide.json").write_text(json.dumps(meta))
    with pytest.raises(DrafterError, match="heldout_ece"):
        load_drafter(folder)


def test_serving_head_keeps_only_a_head_calibrated_within_the_bar():
    head = Confidence(torch.zeros(3), 0.0, torch.ones(2), heldout_ece=MAX_HEAD_ECE)
    assert serving_head(head)[0] is head
    assert serving_head(None) == (None, "no confidence head")
    assert serving_head(Confidence(torch.zeros(3), 0.0, torch.ones(2)))[0] is None  # never measured
    none, reason = serving_head(Confidence(torch.zeros(3), 0.0, torch.ones(2), heldout_ece=0.08))
    assert none is None and "0.0800 > 0.05" in reason


def _head_gauge(version):
    return REGISTRY.get_sample_value("tide_engine_confidence_head", {"drafter_version": version})


def test_an_engine_serves_a_failing_head_on_the_top_probability_chain_and_says_so(tiny_target, tiny_drafter,
                                                                                   caplog):
    caplog.set_level(logging.WARNING, logger="tide.engine.reference")
    engine = ReferenceEngine(tiny_target, None, _with_head(tiny_drafter, 0.08), "h-bad", target_model_id="tiny",
                             draft_len=3, max_batch_size=1, max_seq_len=100)
    try:
        view = engine.health()["confidence_head"]
        assert view["in_use"] is False and "0.0800 > 0.05" in view["reason"]
        assert _head_gauge("h-bad") == 0
        assert any("h-bad" in r.getMessage() and "top-probability chain" in r.getMessage() for r in caplog.records)
        engine.swap_drafter(_with_head(tiny_drafter, 0.02), "h-good")
        list(engine.submit(GenerationRequest("x", (5, 6, 7), SamplingParams(max_new_tokens=2))))  # applies the swap
        assert engine.health()["confidence_head"]["in_use"] is True and _head_gauge("h-good") == 1
    finally:
        engine.close()
