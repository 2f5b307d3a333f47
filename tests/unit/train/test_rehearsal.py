"""Rehearsal fills the replay's shortfall from a pool of the drafter's training workload."""
from __future__ import annotations

import pytest
import torch

from tide.config import ConfigError, TrainConfig, replace
from tide.train.rehearsal import add_rehearsal, rehearsal_count
from tide.train.spill import StateFile
from tide.train.trainer import Sample
from tide.train.window import WindowData, WindowPlan


def plan(recent: int, replay: int) -> WindowPlan:
    return WindowPlan(recent=[f"r{i}" for i in range(recent)], replay=[f"o{i}" for i in range(replay)], heldout=[],
                      window_start_s=None, window_end_s=None, catalog_requests=0, window_requests=0,
                      heldout_in_window=0, recent_tokens=0, replay_tokens=0, heldout_tokens=0, heldout_generated=0)


@pytest.mark.parametrize("settings, recent, replay, expected", [
    ({}, 170, 50, 120),  # the replay asked 170 older requests and found 50
    ({"rehearsal_prompts": 64}, 170, 50, 64),  # no more than the pool
    ({}, 100, 100, 0),  # a dataset with history enough: nothing to fill
    ({"replay_ratio": 0.5}, 101, 20, 31),  # plan_window's rounding: 50.5 -> 51 asked
    ({"replay_ratio": 0.0}, 100, 0, 0),
    ({"patch": True}, 170, 50, 0),  # a shift's patch trains on its window alone
    ({"rehearsal_prompts": 0}, 170, 50, 0),  # off
    ({"backend": "specforge"}, 170, 50, 0),  # SpecForge trains on the table's export
])
def test_count_is_the_replay_shortfall_within_the_pool(settings, recent, replay, expected):
    tc = replace(TrainConfig(), **settings)
    assert rehearsal_count(tc, plan(recent, replay)) == expected


def sample(n: int, seed: int) -> Sample:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n)
    mask[n // 2:] = 1.0
    return Sample(tokens=torch.randint(0, 100, (n,), generator=g), loss_mask=mask,
                  aux=torch.randn(n, 12, generator=g).to(torch.bfloat16),
                  final=torch.randn(n, 4, generator=g).to(torch.bfloat16))


@pytest.mark.parametrize("spill", [True, False])
def test_pool_samples_join_the_window_after_it_truncated_and_bit_identical(tmp_path, spill):
    store = StateFile(tmp_path) if spill else None
    window = [sample(5, 0)]
    data = WindowData(train=list(window), heldout=[sample(4, 1)], train_tokens=5, heldout_tokens=4, missing=0,
                      store=store)
    pool = [sample(10, 2), sample(30, 3), sample(7, 4)]
    try:
        assert add_rehearsal(data, pool, 2, max_seq_len=16) == 2
        assert data.train[0] is window[0] and len(data.train) == 3 and len(data.heldout) == 1
        assert data.train_tokens == 5 + 10 + 16
        for got, want in zip(data.train[1:], pool):
            n = len(got)
            assert (got.spill is not None) == spill
            assert torch.equal(got.tokens, want.tokens[:n]) and torch.equal(got.loss_mask, want.loss_mask[:n])
            for a, b in zip(got.states(), want.states(n)):
                assert torch.equal(a, b)
        assert add_rehearsal(data, pool, 5, max_seq_len=16, all_positions=True) == 3  # the whole pool, no more
        assert torch.equal(data.train[-1].loss_mask, torch.ones(7))  # train.train_on_prompt: every position
    finally:
        data.close()


@pytest.mark.parametrize("writable", [True, False])
def test_the_pool_is_generated_once_per_home_and_served_where_it_cannot_be_cached(tmp_path, caplog, writable):
    """The target (a tiny real one) answers the workload file's prompts; a retrain Job's image is read-only:
    without a prebuilt pool it still trains, generating the pool each time."""
    import json
    import logging

    from tide.config import load_config
    from tide.models.tiny import tiny_llama_checkpoint
    from tide.train.rehearsal import pool_path, rehearsal_pool

    folder = tiny_llama_checkpoint(tmp_path / "target")
    prompts = tmp_path / "base.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about {w}."}) + "\n" for w in ("tea", "maps")))
    home = tmp_path / "home"
    cfg = load_config(overrides={"home": str(home), "train": {"rehearsal_prompts": 2, "rehearsal_workload": str(prompts)},
                                 "model": {"target": str(folder), "model_id": "tiny/t", "aux_layer_ids": [1, 2, 3],
                                           "max_seq_len": 512}}, env={})
    if not writable:
        home.mkdir()
        (home / "train-cache").write_text("a file where the cache folder would go")
    with caplog.at_level(logging.INFO, logger="tide.train.rehearsal"):
        first, second = rehearsal_pool(cfg), rehearsal_pool(cfg)
    generated = [r.getMessage() for r in caplog.records if "generated" in r.getMessage()]
    assert len(generated) == (1 if writable else 2) and pool_path(cfg).exists() == writable, generated
    assert writable or "not cached" in generated[0]
    assert len(first) == len(second) == 2 and all(s.loss_mask.sum() > 0 for s in first)  # answers, not prompts only
    for a, b in zip(first, second):  # greedy: the same answers and states either way
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.states()[0], b.states()[0])


@pytest.mark.parametrize("prompts", [-1, 1025])
def test_a_pool_size_out_of_bounds_is_refused_by_the_config(prompts):
    with pytest.raises(ConfigError, match="rehearsal_prompts"):
        replace(TrainConfig(), rehearsal_prompts=prompts)
