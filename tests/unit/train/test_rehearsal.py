"""Rehearsal fills the replay's shortfall from a pool of the drafter's training workload."""
from __future__ import annotations

import pytest
import torch

from tide.config import TrainConfig, replace
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
def test_the_pool_is_generated_once_per_home_and_served_where_it_cannot_be_cached(tmp_path, monkeypatch, writable):
    """A retrain Job's image is read-only: without a prebuilt pool it still trains, generating it each time."""
    from tide import config
    from tide.train import rehearsal

    cfg = config.load_config(overrides={"home": str(tmp_path), "train": {"rehearsal_prompts": 2}}, env={})
    if not writable:
        (tmp_path / "train-cache").write_text("a file where the cache folder would go")
    built = []
    monkeypatch.setattr(rehearsal, "_generate", lambda c: built.append(c) or [sample(6, 7), sample(4, 8)])
    first, second = rehearsal.rehearsal_pool(cfg), rehearsal.rehearsal_pool(cfg)
    assert len(built) == (1 if writable else 2) and rehearsal.pool_path(cfg).exists() == writable
    for a, b in zip(first, second):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.states()[0], b.states()[0])
