"""Swap watcher refuses bad artifacts while the champion keeps serving; the guard rolls back collapses
and leaves healthy drafters serving."""
import copy
import json
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from tide.drafter.artifact import save_drafter
from tide.drafter.vocab import build_d2t
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine
from tide.ops.guard import CollapseGuard
from tide.ops.swap import SwapWatcher
from tide.train.offline import generate_samples, new_drafter
from tide.train.trainer import train

PROMPT = (9, 10, 11)  # serve_one's prompt


@pytest.fixture()
def setup(tiny_target, tiny_drafter, tmp_path):
    engine = ReferenceEngine(tiny_target, None, tiny_drafter, "1", target_model_id="tiny", draft_len=3,
                             max_batch_size=2, max_seq_len=200)
    champion = {"value": None}
    watcher = SwapWatcher(engine, lambda: champion["value"], smoke_prompt_ids=[5, 6, 7, 8])
    yield engine, watcher, champion, tmp_path
    engine.close()


def candidate(tiny_target, tiny_drafter, seed):
    d = new_drafter(tiny_target, tiny_drafter.shape.draft_vocab_size, torch.zeros(512), seed=seed)
    d.set_vocab_mapping(tiny_drafter.d2t.clone())
    return d.eval()


def serve_one(engine):
    req = GenerationRequest("x", PROMPT, SamplingParams(max_new_tokens=6))
    return [t for ev in engine.submit(req) for t in ev.token_ids]


def test_valid_version_is_swapped_in(setup, tiny_target, tiny_drafter):
    engine, watcher, champion, tmp = setup
    champion["value"] = ("2", save_drafter(candidate(tiny_target, tiny_drafter, 3), tmp / "v2"))
    out = watcher.check_now()
    assert out.status == "swapped" and engine.drafter_version == "2"
    assert watcher.check_now().status == "unchanged"
    assert watcher.previous[0] == "1"


@pytest.mark.parametrize("breakage", ["checksum", "hidden_size", "vocab_mapping", "pickle"])
def test_bad_artifacts_refused_champion_keeps_serving(setup, tiny_target, tiny_drafter, breakage):
    engine, watcher, champion, tmp = setup
    d = candidate(tiny_target, tiny_drafter, 4)
    folder = save_drafter(d, tmp / "bad")
    if breakage == "checksum":
        state = load_file(str(folder / "model.safetensors"))
        state["fc.weight"] *= 2
        save_file(state, str(folder / "model.safetensors"))
    elif breakage == "hidden_size":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["target_hidden_size"] = 128
        (folder / "config.json").write_text(json.dumps(cfg))
    elif breakage == "vocab_mapping":
        d.set_vocab_mapping(build_d2t(torch.arange(512), d.shape.draft_vocab_size))
        folder = save_drafter(d, tmp / "bad")
    else:
        (folder / "model.safetensors").unlink()
        torch.save(d.state_dict(), folder / "pytorch_model.bin")
    champion["value"] = ("3", folder)
    out = watcher.check_now()
    assert out.status == "refused", out
    assert engine.drafter_version == "1"
    assert len(serve_one(engine)) == 6
    assert watcher.check_now().status == "refused"  # not retried


def test_registry_failure_keeps_serving(setup):
    engine, watcher, _, _ = setup

    def broken():
        raise ConnectionError("tracking server down")
    watcher.resolve = broken
    assert watcher.check_now().status == "error"
    assert engine.drafter_version == "1" and len(serve_one(engine)) == 6


def test_collapse_guard_rolls_back_injected_bad_drafter(setup, tiny_target, tiny_drafter):
    engine, watcher, champion, tmp = setup
    reasons = []

    def rollback(reason):
        reasons.append(reason)
        version, drafter = watcher.previous
        watcher.swap_to(version, drafter)

    guard = CollapseGuard(engine, rollback, floor=1.05, min_ratio=0.9, window_forwards=30)
    guard.baselines["1"] = 3.0  # the champion's live mean before the swap
    guard.check()
    bad = candidate(tiny_target, tiny_drafter, 99)
    with torch.no_grad():
        bad.lm_head.weight.normal_()  # randomized weights, promoted by hand
    watcher.swap_to("bad", bad)
    threads = [threading.Thread(target=serve_one, args=(engine,)) for _ in range(12)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert guard.check() is not None
    assert engine.drafter_version == "1" and "bad" in reasons[0]


def agreeing(tiny_target, tiny_drafter):
    """A drafter trained on the target's own greedy output for PROMPT: accepted on serve_one's traffic,
    at every depth the engine drafts (trained on its own chains of draft_len: one-step training left
    later depths to chance, and how far chance went differed between CPUs)."""
    samples = generate_samples(tiny_target, [list(PROMPT)], 12, eos_ids=(), progress=False)
    d = new_drafter(tiny_target, tiny_drafter.shape.draft_vocab_size, torch.zeros(512), seed=1)
    d.set_vocab_mapping(tiny_drafter.d2t.clone())
    train(d, tiny_target.embed_weight, tiny_target.lm_head_weight, samples, epochs=80, lr=3e-2, batch_tokens=512,
          max_len=256, ttt_length=3, step_weight=0.8, seed=1, progress=False)
    return d.eval()


def serve_window(engine):
    """Two rounds of the collapse test's traffic: more than its 30-forward window."""
    for _ in range(2):
        threads = [threading.Thread(target=serve_one, args=(engine,)) for _ in range(12)]
        [t.start() for t in threads]
        [t.join() for t in threads]


def test_collapse_guard_keeps_a_healthy_drafter_serving(tiny_target, tiny_drafter):
    good = agreeing(tiny_target, tiny_drafter)
    # every step drafts draft_len: the costed schedulers verify fewer drafts when the machine's load
    # makes drafting cost more, which moves tokens per forward apart from the drafter (the guard's
    # rollback under the default scheduler: tests/unit/spec/test_guard_default.py)
    engine = ReferenceEngine(tiny_target, None, good, "1", target_model_id="tiny", draft_len=3,
                             max_batch_size=2, max_seq_len=200, scheduler="fixed")
    watcher = SwapWatcher(engine, lambda: None, smoke_prompt_ids=[5, 6, 7, 8])
    reasons = []
    # the collapse test's guard, with the previous version's baseline measured live here
    guard = CollapseGuard(engine, reasons.append, floor=1.05, min_ratio=0.9, window_forwards=30)
    try:
        guard.check()
        serve_window(engine)
        assert guard.check() is None and guard.baselines["1"] > 2.0, guard.baselines  # accepted: healthy
        # a new version as good as the champion (a retrain that converged to the same weights)
        assert watcher.swap_to("2", copy.deepcopy(good)).status == "swapped"
        guard.check()
        for _ in range(3):  # three judged windows, where the collapse test needs one to roll back
            guard.baselines.pop("2", None)
            serve_window(engine)
            assert guard.check() is None
            assert guard.baselines["2"] >= 0.9 * guard.baselines["1"], guard.baselines  # judged, kept
        assert reasons == [] and engine.drafter_version == "2"
    finally:
        engine.close()
