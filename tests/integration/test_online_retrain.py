"""The retrain job end to end on real parts: the dataset table written by the dataset writer from a
real (tiny, H=64) target's states, a real MLflow SQLite store, and `tide train --online` as the
subprocess the scheduler launches (killed with SIGKILL in one test)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tide.config import load_config
from tide.contracts import (
    CHALLENGER,
    CHAMPION,
    TAG_BASELINE,
    TAG_BASELINE_SIM_ACCEPT,
    TAG_PARENT,
    TAG_PARENT_SIM_ACCEPT,
    TAG_PATCH,
)
from tide.contracts import RETRAIN_NOTHING_TO_DO as NOTHING_TO_DO
from tide.drafter.artifact import TargetSpec, load_drafter, save_drafter
from tide.drafter.static import cached_static_path
from tide.drafter.vocab import mapping_digest
from tide.registry import Registry
from tide.train.capture_log import log_samples
from tide.train.online import run_cli

REPO = Path(__file__).resolve().parents[2]
MODEL_ID = "tiny/test-target"
AUX = (1, 2, 3)
T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """Tiny target checkpoint, a static drafter for it, and 72 generated requests (states + prompt lengths)."""
    from transformers import AutoTokenizer

    from tide.engine.reference import eos_ids_of
    from tide.models.llama import LlamaTarget
    from tide.models.tiny import tiny_llama_checkpoint
    from tide.train.offline import generate_samples, new_drafter, render_prompt

    root = tmp_path_factory.mktemp("tiny-retrain")
    folder = tiny_llama_checkpoint(root / "target")
    target = LlamaTarget.from_folder(folder, aux_layer_ids=AUX, max_seq_len=256)
    tok = AutoTokenizer.from_pretrained(folder)
    topics = ["a stack", "the weather", "fibonacci numbers", "a robot who paints", "tea", "sorting a list"]
    prompts = [render_prompt(tok, f"Tell me about {topics[i % 6]}, part {i}.", 64) for i in range(72)]
    samples = generate_samples(target, prompts, 20, eos_ids_of(tok, folder), progress=False)
    counts = torch.bincount(torch.cat([s.tokens for s in samples]), minlength=target.shape.vocab_size)
    drafter = new_drafter(target, 256, counts, seed=0)
    static = save_drafter(drafter, root / "static", metadata={"version": "static"})
    return folder, static, samples, [len(p) for p in prompts]


def make_home(tmp_path, tiny_setup, n_requests: int, **train) -> tuple[Path, Path]:
    """A TIDE home with the static drafter, ``n_requests`` logged requests and a config file."""
    folder, static, samples, prompt_lens = tiny_setup
    home = tmp_path / "home"
    import shutil
    shutil.copytree(static, cached_static_path(home))
    log_samples(home / "dataset", samples[:n_requests], prompt_lens[:n_requests], target_model_id=MODEL_ID,
                aux_layer_ids=AUX, start_s=T0, id_prefix="req", max_message_bytes=60_000, rows_per_file=16)
    cfg = {
        "home": str(home),
        "model": {"target": str(folder), "model_id": MODEL_ID, "aux_layer_ids": list(AUX), "max_seq_len": 256},
        "spec": {"draft_len": 3},
        "train": {"epochs": 1, "batch_tokens": 1024, "max_seq_len": 128, "ttt_length": 2, "lr": 1e-3,
                  "window_samples": 48, "replay_ratio": 0.25, "heldout_fraction": 0.2, "min_samples": 8,
                  "max_train_s": 120, **train},
    }
    path = tmp_path / "tide.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return home, path


def retrain_cmd(config: Path, result: Path) -> list[str]:
    return [sys.executable, "-m", "tide.cli", "train", "--online", "--config", str(config),
            "--result-json", str(result)]


def run_job(config: Path, result: Path, timeout_s: float = 400, env: dict | None = None) -> tuple[int, dict, str]:
    proc = subprocess.run(retrain_cmd(config, result), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    payload = json.loads(result.read_text()) if result.exists() else {}
    return proc.returncode, payload, proc.stderr[-4000:]


def test_too_few_samples_is_nothing_to_do(tmp_path, tiny_setup):
    home, config = make_home(tmp_path, tiny_setup, 6)
    result, summary = tmp_path / "result.json", tmp_path / "termination-log"
    assert run_cli(load_config(config), str(result), summary_json=str(summary)) == 0
    payload = json.loads(result.read_text())
    assert payload["status"] == NOTHING_TO_DO and payload["version"] is None
    assert "need 8" in payload["reason"]
    # what a Kubernetes Job leaves in its termination message for the scheduler
    assert json.loads(summary.read_text()) == {k: payload[k] for k in ("status", "version", "run_id", "reason",
                                                                   "data_table_version")}
    assert run_cli(load_config(config), str(result), summary_json=str(tmp_path)) == 0  # unwritable: still 0
    assert Registry.from_config(load_config(config)).list_versions(include_incomplete=True) == []


def test_enough_samples_register_a_challenger_with_lineage(tmp_path, tiny_setup):
    home, config = make_home(tmp_path, tiny_setup, 72)
    code, payload, err = run_job(config, tmp_path / "result.json")
    assert code == 0, err
    assert payload["status"] == "registered" and payload["version"] == 2, payload
    cfg = load_config(config)
    registry = Registry.from_config(cfg)
    assert registry.aliases() == {CHAMPION: 1, CHALLENGER: 2}  # static bootstrapped as v1 champion
    static, version = registry.get_version(1), registry.get_version(2)
    assert static.kind == "static"
    tags = version.tags
    assert tags["tide.kind"] == "retrain" and tags["tide.parent_version"] == "1"
    assert float(tags["tide.data_window_start_s"]) == T0 + 24 and float(tags["tide.data_window_end_s"]) == T0 + 71
    assert int(tags["tide.recent_requests"]) + int(tags["tide.heldout_requests"]) <= 48
    assert int(tags["tide.replay_requests"]) > 0 and tags["tide.code_version"]
    assert tags["tide.vocab_mapping"] == static.tags["tide.vocab_mapping"]  # vocab kept fixed
    from tide.dataset.table import DatasetTable
    assert int(tags["tide.data_table_version"]) == payload["data_table_version"] == DatasetTable(home / "dataset").version()
    assert tags["tide.data_table_uri"] == str(home / "dataset")
    metrics = version.metrics
    for key in ("candidate_sim_accept_length", "champion_sim_accept_length", "candidate_heldout_loss",
                "champion_heldout_loss", "train_tokens_per_s", "candidate_replayed_accept_length",
                "champion_replayed_accept_length"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    assert float(tags["tide.sim_accept_length"]) == pytest.approx(metrics["candidate_sim_accept_length"], abs=1e-4)
    # by workload tag: this window's requests carry none, so one group, the whole held-out slice
    assert metrics["heldout_positions.untagged"] == metrics["heldout_positions"] > 0
    for who in ("candidate", "champion"):
        assert metrics[f"{who}_sim_accept_length.untagged"] == pytest.approx(metrics[f"{who}_sim_accept_length"])
    # memory per phase of the retrain (tide/train/memory.py), each within the process peak
    phases = ("plan", "target", "window", "eval_parent", "teacher", "train", "eval_candidate", "register")
    assert metrics["peak_rss_gib_exact"] == 1.0
    for phase in phases:
        assert 0 < metrics[f"peak_rss_gib.{phase}"] <= metrics["peak_rss_gib"], phase
    losses = registry.client.get_metric_history(version.run_id, "train_loss")
    assert len(losses) == metrics["train_steps"] > 0
    assert version.params["parent_version"] == "1" and version.params["window_start_s"] == str(T0 + 24)
    assert version.params["train.update_fraction"] == str(cfg.train.update_fraction)  # how much of the change was kept
    local = registry.download(2)
    spec = TargetSpec(64, 512, AUX)
    trained, parent = load_drafter(local, spec), load_drafter(registry.download(1), spec)
    assert mapping_digest(trained.d2t) == mapping_digest(parent.d2t)
    assert not torch.equal(trained.fc.weight, parent.fc.weight)  # it did train
    assert trained.confidence is not None  # train.confidence_head is on by default: the head is fitted
    # stored in bf16, and the registered metrics were measured on those rounded weights
    from safetensors import safe_open
    with safe_open(str(local / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert registry.client.get_run(version.run_id).info.status == "FINISHED"

    # the same window, exported for SpecForge with the champion's (fixed) vocab mapping
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    from tide.train.online import export_window
    manifest = export_window(cfg, tmp_path / "specforge")
    assert manifest["samples"] == int(tags["tide.recent_requests"]) + int(tags["tide.replay_requests"])
    assert len(OfflineManifestReader(str(tmp_path / "specforge")).read()) == manifest["samples"]
    mapping = torch.load(tmp_path / "specforge" / "vocab_mapping" / "vocab_mapping.pt")
    assert torch.equal(mapping["d2t"], parent.d2t)


def test_a_young_dataset_s_replay_shortfall_is_rehearsed_from_the_drafter_s_workload(tmp_path, tiny_setup):
    """The replay asks twice the recent requests, the dataset holds fewer older ones: the target's
    answers to the rehearsal workload's prompts fill in (generated once, cached, in the lineage). The
    file holds fewer prompts than ``rehearsal_prompts``: the lineage records what was added."""
    from tide.train.generation_pool import load_samples
    from tide.train.rehearsal import pool_path, rehearsal_pool

    prompts = tmp_path / "base.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say something about {w}."}) + "\n"
                               for w in ("tea", "rain", "cats", "maps", "jazz", "salt")))
    home, config = make_home(tmp_path, tiny_setup, 72, replay_ratio=2.0, rehearsal_prompts=10,
                             rehearsal_workload=str(prompts))
    code, payload, err = run_job(config, tmp_path / "result.json")
    assert code == 0 and payload["status"] == "registered", err
    cfg = load_config(config)
    version = Registry.from_config(cfg).get_version(payload["version"])
    params = version.params
    recent, replay = int(params["recent_requests"]), int(params["replay_requests"])
    assert 2 * recent - replay >= 10  # a shortfall larger than the pool asked for
    pool = load_samples(pool_path(cfg))
    assert 0 < len(pool) <= 6 and all(s.loss_mask.sum() > 0 for s in pool)  # the target answered each prompt
    n = str(len(pool))  # all the file's train split holds, fewer than the 10 asked
    assert params["rehearsal_requests"] == n
    assert (version.tags["tide.rehearsal_requests"], version.tags["tide.rehearsal_pool"]) == (n, pool_path(cfg).name)
    assert int(params["train_samples"]) == recent + replay + len(pool)
    stamp = pool_path(cfg).stat().st_mtime_ns
    assert len(rehearsal_pool(cfg)) == len(pool) and pool_path(cfg).stat().st_mtime_ns == stamp  # read, not rebuilt


def test_a_retrain_after_a_patch_starts_from_the_patch_s_parent_and_is_compared_with_the_patch(tmp_path, tiny_setup):
    home, config = make_home(tmp_path, tiny_setup, 72)
    code, payload, err = run_job(config, tmp_path / "patch.json", env={"TIDE_TRAIN__PATCH": "true"})  # a shift's
    assert code == 0 and payload["version"] == 2, err
    cfg = load_config(config)
    registry = Registry.from_config(cfg)
    registry.promote(2, actor="test")
    # the full retrain keeps a twentieth of its change: its weights sit next to its warm start's
    code, payload, err = run_job(config, tmp_path / "full.json", env={"TIDE_TRAIN__UPDATE_FRACTION": "0.05"})
    assert code == 0 and payload["version"] == 3, err
    patch, full = registry.get_version(2), registry.get_version(3)
    assert patch.tags[TAG_PATCH] == "true" and TAG_PATCH not in full.tags
    assert (patch.tags[TAG_PARENT], patch.tags[TAG_BASELINE]) == ("1", "1")
    assert (full.tags[TAG_PARENT], full.tags[TAG_BASELINE]) == ("1", "2")
    metrics = full.metrics
    assert float(full.tags[TAG_BASELINE_SIM_ACCEPT]) == pytest.approx(metrics["champion_sim_accept_length"], abs=1e-4)
    assert float(full.tags[TAG_PARENT_SIM_ACCEPT]) == pytest.approx(metrics["parent_sim_accept_length"], abs=1e-4)
    spec = TargetSpec(64, 512, AUX)
    v1, v2, v3 = (load_drafter(registry.download(v), spec) for v in (1, 2, 3))

    def distance(a, b) -> float:
        return sum(float((x.detach().float() - y.detach().float()).norm()) for x, y in zip(a.parameters(), b.parameters()))

    assert distance(v3, v1) < 0.5 * distance(v3, v2)  # started from version 1, not from the patch


def test_confidence_head_is_fitted_registered_and_loaded(tmp_path, tiny_setup):
    """train.confidence_head: the candidate carries a calibrated head (checksummed beside the
    weights), and its calibration errors are the version's metrics."""
    home, config = make_home(tmp_path, tiny_setup, 72, confidence_head=True)
    code, payload, err = run_job(config, tmp_path / "result.json")
    assert code == 0, err
    registry = Registry.from_config(load_config(config))
    version = registry.get_version(payload["version"])
    for key in ("confidence_ece", "confidence_ece_raw", "confidence_ece_top_prob"):
        assert 0.0 <= version.metrics[key] <= 1.0, key
    assert 0 < version.metrics["peak_rss_gib.confidence"] <= version.metrics["peak_rss_gib"]
    trained = load_drafter(registry.download(payload["version"]), TargetSpec(64, 512, AUX), require_checksum=True)
    assert trained.confidence is not None and len(trained.confidence.temperature) == 3  # spec.draft_len
    assert bool((trained.confidence.temperature > 0).all())


def test_killed_retrain_leaves_no_version_and_the_next_one_succeeds(tmp_path, tiny_setup):
    home, config = make_home(tmp_path, tiny_setup, 72, epochs=500, max_train_s=600)
    log_path = tmp_path / "killed.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(retrain_cmd(config, tmp_path / "killed.json"), cwd=REPO, stdout=log_file,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 300
        while "retrain: training" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the job never started training"
            time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)  # mid-training: epochs=500 run far past this point
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    cfg = load_config(config)
    registry = Registry.from_config(cfg)
    assert [v.version for v in registry.list_versions(include_incomplete=True)] == [1]  # only the bootstrap
    assert registry.aliases() == {CHAMPION: 1}
    killed = registry.client.search_runs([registry.experiment_id], "tags.`tide.kind` = 'retrain'")
    assert [r.info.status for r in killed] == ["RUNNING"]
    assert list((home / "retrain").glob("work-*"))  # its work folder was left behind

    # the next job cleans up after it and succeeds
    fast = yaml.safe_load(config.read_text())
    fast["train"].update(epochs=1, max_train_s=120)
    config.write_text(yaml.safe_dump(fast))
    code, payload, err = run_job(config, tmp_path / "result.json")
    assert code == 0 and payload["status"] == "registered", err
    assert payload["version"] == 2 and registry.aliases() == {CHAMPION: 1, CHALLENGER: 2}
    assert registry.client.get_run(killed[0].info.run_id).info.status == "KILLED"
    assert not list((home / "retrain").glob("work-*"))


def test_sigterm_unwinds_cleanly(tmp_path, tiny_setup):
    """The scheduler's timeout sends SIGTERM first: the job marks its run KILLED, registers
    nothing, removes its work folder and reports the interruption."""
    home, config = make_home(tmp_path, tiny_setup, 72, epochs=500, max_train_s=600)
    log_path, result = tmp_path / "job.log", tmp_path / "result.json"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(retrain_cmd(config, result), cwd=REPO, stdout=log_file,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 300
        while "retrain: training" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    payload = json.loads(result.read_text())
    assert payload["status"] == "failed" and "interrupted" in payload["reason"]
    registry = Registry.from_config(load_config(config))
    assert [v.version for v in registry.list_versions(include_incomplete=True)] == [1]
    runs = registry.client.search_runs([registry.experiment_id], "tags.`tide.kind` = 'retrain'")
    assert [r.info.status for r in runs] == ["KILLED"]
    assert not list((home / "retrain").glob("work-*"))


def test_torchrun_two_ranks_train_and_only_rank_0_registers(tmp_path, tiny_setup):
    """``tide train --online`` under torchrun (2 gloo ranks): one version, from one MLflow run."""
    home, config = make_home(tmp_path, tiny_setup, 72, device="cpu")
    result = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           *retrain_cmd(config, result)[2:]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    payload = json.loads(result.read_text())
    assert payload["status"] == "registered" and payload["version"] == 2, payload
    registry = Registry.from_config(load_config(config))
    assert sorted(v.version for v in registry.list_versions(include_incomplete=True)) == [1, 2]
    metrics = registry.get_version(2).metrics
    assert metrics["train_ranks"] == 2 and metrics["train_steps"] > 0 and metrics["train_tokens_per_s"] > 0
    runs = registry.client.search_runs([registry.client.get_run(payload["run_id"]).info.experiment_id])
    assert len([r for r in runs if r.data.tags.get("tide.kind") == "retrain"]) == 1


def test_cuda_device_without_a_gpu_fails_with_a_clear_reason(tmp_path, tiny_setup, monkeypatch):
    home, config = make_home(tmp_path, tiny_setup, 72, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = tmp_path / "result.json"
    assert run_cli(load_config(config), str(result)) == 1
    payload = json.loads(result.read_text())
    assert payload["status"] == "failed" and "train.device is 'cuda' but no GPU is usable" in payload["reason"]
    assert Registry.from_config(load_config(config)).list_versions(include_incomplete=True) == []


def test_a_retrain_re_run_on_its_registered_table_version_selects_the_same_data(tmp_path, tiny_setup):
    """The registered version names the table version its retrain read; planning on that version
    again, after more traffic arrived, selects exactly the recent, replay and held-out requests
    the retrain logged, while the newest version selects a different window."""
    from tide.dataset.table import DatasetTable
    from tide.train.online import plan_for

    home, config = make_home(tmp_path, tiny_setup, 48)
    code, payload, err = run_job(config, tmp_path / "result.json")
    assert code == 0 and payload["status"] == "registered", err
    cfg = load_config(config)
    registry = Registry.from_config(cfg)
    version = registry.get_version(payload["version"])
    read = int(version.tags["tide.data_table_version"])
    assert read == payload["data_table_version"] == DatasetTable(home / "dataset").version()
    logged = json.loads(Path(registry.client.download_artifacts(version.run_id, "retrain.json",
                                                                str(tmp_path))).read_text())["request_ids"]
    _, _, samples, prompt_lens = tiny_setup  # 24 more requests, newer: the newest window moves
    log_samples(home / "dataset", samples[48:], prompt_lens[48:], target_model_id=MODEL_ID, aux_layer_ids=AUX,
                start_s=T0 + 48, id_prefix="late", first_offset=10_000, max_message_bytes=60_000, rows_per_file=16)
    again = plan_for(cfg, version=read)
    assert {"recent": again.recent, "replay": again.replay, "heldout": again.heldout} == logged
    assert again.data_version == read
    newest = plan_for(cfg)
    assert newest.data_version > read and newest.recent != again.recent
    # the same through the retrain's own setting (TIDE_TRAIN__DATA_VERSION)
    pinned = load_config(config, env={"TIDE_TRAIN__DATA_VERSION": str(read)})
    assert plan_for(pinned).recent == logged["recent"]
