"""Real target (SmolLM2-135M-Instruct), real drafters, batched reference engine:
speculative greedy output is token-for-token identical to target-only greedy output on 50
varied prompts (chat, code, long), with the trained static drafter and with a random drafter.

Target-only greedy output is decoded once (module fixture): greedy decoding's first n tokens do
not depend on how many come after, so the random drafter's shorter runs compare against its prefix."""
from __future__ import annotations

import threading

import pytest
import torch

from tide import workloads
from tide.config import load_config
from tide.drafter.artifact import TargetSpec, load_drafter
from tide.drafter.static import static_drafter_path
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine, load_target
from tide.train.offline import new_drafter, render_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(overrides={"model": {"torch_threads": 1}})
    target, tok, _ = load_target(cfg)
    chat = workloads.load_workload("chat", "heldout", 20, seed=3)
    code = workloads.load_workload("code", "heldout", 15, seed=3)
    long_src = workloads.load_workload("chat", "train", 200, seed=5)
    long = sorted(long_src, key=lambda p: -len(p.chat_messages()[-1]["content"]))[:15]
    prompts = [render_prompt(tok, p.chat_messages(), 640) for p in chat + code + long]
    assert len(prompts) == 50 and max(len(p) for p in prompts) > 300
    return cfg, target, tok, prompts


REF_TOKENS = 24  # the longest run below


@pytest.fixture(scope="module")
def target_only(setup):
    """Target-only greedy output of every prompt, REF_TOKENS long (shorter where a stop came)."""
    _, target, tok, prompts = setup
    ref, _ = run_engine(target, tok, None, prompts, REF_TOKENS)
    return ref


def _prefixes(ref: list[list[int]], n: int) -> list[list[int]]:
    return [out[:n] for out in ref]


def run_engine(target, tok, drafter, prompts, max_new_tokens, gamma=4):
    engine = ReferenceEngine(target, tok, drafter, "test" if drafter is not None else "none",
                             target_model_id="smollm2", draft_len=gamma, max_batch_size=8, max_seq_len=1024)
    outs: dict[int, list[int]] = {}
    try:
        def one(i, ids):
            req = GenerationRequest(f"r{i}", tuple(ids), SamplingParams(max_new_tokens=max_new_tokens))
            outs[i] = [t for ev in engine.submit(req) for t in ev.token_ids]
        threads = [threading.Thread(target=one, args=(i, ids)) for i, ids in enumerate(prompts)]
        [t.start() for t in threads]
        [t.join(timeout=900) for t in threads]
        return [outs[i] for i in range(len(prompts))], engine.stats()
    finally:
        engine.close()


def test_static_drafter_greedy_identical_and_accepts(setup, target_only):
    cfg, target, tok, prompts = setup
    drafter = load_drafter(static_drafter_path(cfg), TargetSpec(576, 49152, target.aux_layer_ids))
    ref = target_only
    out, stats = run_engine(target, tok, drafter, prompts, REF_TOKENS)
    mismatches = [i for i, (a, b) in enumerate(zip(ref, out)) if a != b]
    assert not mismatches, f"prompts {mismatches} differ"
    assert stats.acceptance["test"].tokens_per_forward > 1.1  # the trained drafter does get tokens accepted


def test_random_drafter_greedy_identical(setup, target_only):
    cfg, target, tok, prompts = setup
    drafter = new_drafter(target, 4096, torch.arange(49152).flip(0), seed=7).eval()
    ref = _prefixes(target_only, 12)
    out, _ = run_engine(target, tok, drafter, prompts, 12)
    assert [i for i, (a, b) in enumerate(zip(ref, out)) if a != b] == []
