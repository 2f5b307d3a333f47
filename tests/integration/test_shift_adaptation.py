"""A workload shift, end to end on the real target: ShareGPT chat traffic, then code traffic;
the online retrain (window = the code requests, ShareGPT replayed) yields a candidate whose
simulated acceptance length on held-out code requests beats the static drafter's.

Real parts: SmolLM2-135M-Instruct's own states (``generate_samples`` on ShareGPT and code
prompts), written through the dataset writer and read back through the dataset reader, a real
MLflow SQLite store, the static drafter trained by ``tide train --static``. Generated states are
cached under ``<home>/train-cache/shift-test`` so re-runs skip generation.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tide.config import load_config
from tide.contracts import CHALLENGER, CHAMPION
from tide.contracts import RETRAIN_REGISTERED as REGISTERED
from tide.drafter.artifact import DrafterError
from tide.drafter.static import cached_static_path, static_drafter_path
from tide.registry import Registry
from tide.train.capture_log import log_samples
from tide.train.online import plan_for, run_retrain

pytestmark = pytest.mark.slow

N_CHAT, N_CODE = 32, 40
MAX_NEW_TOKENS, MAX_PROMPT_TOKENS = 64, 160
T0 = 1_750_000_000.0


def _cached_samples(path: Path, make):
    from tide.train.generation_pool import load_samples, save_samples

    if path.exists():
        return load_samples(path)
    samples = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_samples(samples, path)
    return samples


@pytest.fixture(scope="module")
def real():
    from tide import workloads
    from tide.engine.reference import eos_ids_of, load_target
    from tide.train.offline import generate_samples, render_prompt

    torch.set_num_threads(1)
    cfg = load_config(overrides={"model": {"torch_threads": 1}})
    try:
        static = static_drafter_path(cfg)
    except DrafterError as exc:
        pytest.skip(f"needs the static drafter: {exc}")
    target, tok, folder = load_target(cfg)
    eos = eos_ids_of(tok, folder)
    cache = cfg.home_path / "train-cache" / "shift-test"

    def generate(prompts):
        ids = [render_prompt(tok, p.chat_messages(), MAX_PROMPT_TOKENS) for p in prompts]
        return generate_samples(target, ids, MAX_NEW_TOKENS, eos, progress=False)

    chat_path = cache / f"chat-{N_CHAT}-{MAX_NEW_TOKENS}.safetensors"
    static_cache = sorted((cfg.home_path / "train-cache" / "static").glob("train-*.safetensors"))
    if not chat_path.exists() and static_cache:  # the static recipe's own ShareGPT states
        from tide.train.generation_pool import load_samples
        chat = load_samples(static_cache[-1])[:N_CHAT]
    else:
        chat = _cached_samples(chat_path, lambda: generate(
            workloads.sharegpt("train", N_CHAT, 1, kind="chat", home=cfg.home_path)))
    code = _cached_samples(cache / f"code-{N_CODE}-{MAX_NEW_TOKENS}.safetensors",
                           lambda: generate(workloads.code("train", N_CODE, 1, home=cfg.home_path)))
    return cfg, static, folder, chat, code


def test_code_traffic_after_sharegpt_adapts_the_drafter(real, tmp_path):
    cfg, static, folder, chat, code = real
    home = tmp_path / "home"
    shutil.copytree(static, cached_static_path(home))
    aux = tuple(json.loads((static / "config.json").read_text())["tide_aux_layer_ids"])
    log_samples(home / "dataset", chat, target_model_id=cfg.model.model_id, aux_layer_ids=aux,
                start_s=T0, workload="chat", id_prefix="chat")
    log_samples(home / "dataset", code, target_model_id=cfg.model.model_id, aux_layer_ids=aux,
                start_s=T0 + 3600, workload="code", id_prefix="code", first_offset=10_000)
    run_cfg = load_config(overrides={
        "home": str(home),
        "model": {"target": str(folder), "torch_threads": 1},
        # the data selection is the test's; the optimisation is TIDE's defaults (what the demo runs)
        "train": {"window_samples": N_CODE, "window_s": 0, "replay_ratio": 0.25, "heldout_fraction": 0.25,
                  "min_samples": 16, "max_seq_len": MAX_PROMPT_TOKENS + MAX_NEW_TOKENS,
                  "max_train_tokens": 0, "max_train_s": 240, "rehearsal_prompts": 0},  # replay only
    })
    plan = plan_for(run_cfg)
    assert plan.heldout and all(r.startswith("code-") for r in plan.heldout + plan.recent)
    assert plan.replay and all(r.startswith("chat-") for r in plan.replay)

    result = run_retrain(run_cfg)
    assert result.status == REGISTERED, result
    m = result.metrics
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()}, indent=1))
    registry = Registry.from_config(run_cfg)
    assert registry.aliases() == {CHAMPION: 1, CHALLENGER: 2}
    assert registry.get_version(1).kind == "static"  # the champion evaluated is the static drafter
    assert m["heldout_positions"] >= 200
    # the adapted candidate beats the static drafter on the same held-out code requests
    assert m["candidate_sim_accept_length"] > m["champion_sim_accept_length"] + 0.05, m
