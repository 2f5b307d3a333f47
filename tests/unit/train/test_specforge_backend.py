"""The SpecForge backend (train.backend: specforge) on a CPU machine: the config key, the refusal
before any work, the run config and commands checked against SpecForge 0.2.0's own config
schema and CLI, the capped subprocess, and the import of its output through TIDE's validation.
SpecForge's trainer itself needs a GPU and is not run here."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from tide.config import ConfigError, load_config  # noqa: E402
from tide.drafter.artifact import DrafterError, TargetSpec, save_drafter  # noqa: E402
from tide.drafter.vocab import mapping_digest  # noqa: E402
from tide.train import specforge_backend as sb  # noqa: E402

sf_config = pytest.importorskip("specforge.config", reason="specforge must be installed (scripts/install.sh)")


def _spec(target) -> TargetSpec:
    return TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)


def test_config_accepts_the_two_backends_and_refuses_others():
    assert load_config(env={}).train.backend == "tide"
    assert load_config(env={}, overrides={"train": {"backend": "specforge"}}).train.backend == "specforge"
    with pytest.raises(ConfigError, match="train.backend.*not one of"):
        load_config(env={}, overrides={"train": {"backend": "deepspeed"}})
    with pytest.raises(ConfigError, match="train.backend"):
        load_config(env={"TIDE_TRAIN__BACKEND": "SpecForge"})


def test_require_refuses_without_gpu_or_specforge(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(sb.SpecForgeError, match="train.backend is 'specforge' but no GPU is usable"):
        sb.require()
    assert not sb.available()
    monkeypatch.setattr(sb.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(sb.SpecForgeError, match="SpecForge is not installed"):
        sb.require()
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sb.available()
    with pytest.raises(sb.SpecForgeError, match="2 torchrun ranks"):
        sb.require(world=2)


def test_retrain_cli_fails_before_any_work(tmp_path, monkeypatch):
    from tide.train.online import run_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(env={}, overrides={"home": str(tmp_path / "home"), "train": {"backend": "specforge"}})
    result = tmp_path / "result.json"
    assert run_cli(cfg, str(result)) == 1
    payload = json.loads(result.read_text())
    assert payload["status"] == "failed" and "SpecForgeError" in payload["reason"]
    assert "no GPU is usable" in payload["reason"]
    assert not (tmp_path / "home").exists()  # no registry, run, work folder or export was started


def test_run_config_validates_against_specforge_schema(tmp_path):
    tc = load_config(env={}, overrides={"train": {"lr": 2e-4, "epochs": 3, "ttt_length": 5,
                                                  "batch_tokens": 2048, "max_seq_len": 512}}).train
    layout = sb.Layout(tmp_path / "sf")
    path = tmp_path / "run.json"
    path.write_text(json.dumps(sb.run_config(tc, layout, tmp_path / "target")))
    cfg = sf_config.load_config(str(path), [])  # SpecForge's own loader and pydantic schema
    assert cfg.mode == "offline"
    assert cfg.model.draft_checkpoint_path == str(layout.warm_start)
    assert cfg.model.draft_model_config == str(layout.warm_start / "config.json")
    assert cfg.model.target_model_path == str(tmp_path / "target")
    assert cfg.model.vocab_mapping_path == str(layout.data / "vocab_mapping" / "vocab_mapping.pt")
    assert cfg.data.hidden_states_path == str(layout.data) and cfg.data.max_length == 512
    assert cfg.output_dir == str(layout.output) and cfg.training.resume_from is None
    t = cfg.training
    assert (t.strategy, t.learning_rate, t.num_epochs, t.ttt_length, t.batch_size, t.seed) == \
        ("eagle3", 2e-4, 3, 5, 4, tc.seed)


def test_commands_parse_with_specforge_cli(tmp_path):
    from specforge.cli import main

    layout = sb.Layout(tmp_path / "sf")
    train = sb.train_command(layout)
    assert train[:4] == [sys.executable, "-m", "specforge.cli", "train"]
    assert train[train.index("--config") + 1] == str(layout.config)
    export = sb.export_command(layout, tmp_path / "missing-step7")
    for flag, value in (("--checkpoint", tmp_path / "missing-step7"), ("--output-dir", layout.exported),
                        ("--draft-config", layout.warm_start / "config.json"), ("--to", "sglang")):
        assert export[export.index(flag) + 1] == str(value)
    # the flags parse (argparse would exit 2); SpecForge then looks for the checkpoint itself
    with pytest.raises(FileNotFoundError, match="missing-step7"):
        main(export[3:])


def test_import_of_a_safetensors_folder_enforces_the_vocab_mapping(tiny_target, tiny_drafter, tmp_path):
    folder = save_drafter(tiny_drafter, tmp_path / "exported", dtype=torch.bfloat16)
    got = sb.import_checkpoint(folder, _spec(tiny_target), mapping_digest(tiny_drafter.d2t))
    assert torch.equal(got.d2t, tiny_drafter.d2t)
    assert torch.equal(got.fc.weight, tiny_drafter.fc.weight.to(torch.bfloat16).float())
    other = tiny_drafter.d2t.clone()
    other[[0, 1]] = other[[1, 0]] + torch.tensor([1, -1])  # two draft ids swap their target ids
    with pytest.raises(DrafterError, match="differs from the serving mapping"):
        sb.import_checkpoint(folder, _spec(tiny_target), mapping_digest(other))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "training_state.pt"])
def test_pickle_only_checkpoint_is_refused_unread(tmp_path, tiny_target, name):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / name).write_bytes(b"not a pickle: unpickling would raise something else")
    (folder / "config.json").write_text("{}")
    with pytest.raises(sb.SpecForgeError, match="only pickle checkpoints.*model.safetensors only"):
        sb.import_checkpoint(folder, _spec(tiny_target), "any")


def test_pickle_beside_safetensors_is_refused(tiny_target, tiny_drafter, tmp_path):
    folder = save_drafter(tiny_drafter, tmp_path / "exported")
    (folder / "training_state.pt").write_bytes(b"x")
    with pytest.raises(DrafterError, match="refusing pickle weights"):
        sb.import_checkpoint(folder, _spec(tiny_target), mapping_digest(tiny_drafter.d2t))


def test_final_checkpoint_is_the_highest_step(tmp_path):
    with pytest.raises(sb.SpecForgeError, match="no tide-step"):
        sb.final_checkpoint(tmp_path)
    for step in (9, 120, 30):
        (tmp_path / f"tide-step{step}").mkdir()
    (tmp_path / "tide-step999.tmp").mkdir()
    assert sb.final_checkpoint(tmp_path) == (tmp_path / "tide-step120", 120)


def test_capped_run_kills_its_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(600)']); open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(600)")
    t0 = time.monotonic()
    with pytest.raises(sb.SpecForgeError, match="ran past 2 s"):
        sb.run_capped("fake trainer", [sys.executable, "-c", script, str(pid_file)], tmp_path / "log", 2.0, tmp_path)
    assert time.monotonic() - t0 < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)  # the grandchild went with the group


def test_failed_run_reports_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('boom: no driver'); sys.exit(3)"]
    with pytest.raises(sb.SpecForgeError, match=r"(?s)fake trainer exited 3.*boom: no driver"):
        sb.run_capped("fake trainer", cmd, tmp_path / "log", 60.0, Path(tmp_path))


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # not our child: raises; reaped zombies count as dead
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0


def test_specforge_warm_starts_from_tide_artifact(tiny_drafter, tmp_path):
    """SpecForge's own weights-only warm start reads the champion folder TIDE writes."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.training.model_loading import warm_start_draft_model
    from transformers import LlamaConfig

    folder = save_drafter(tiny_drafter, sb.Layout(tmp_path).warm_start)
    draft_config = LlamaConfig(**json.loads((folder / "config.json").read_text()))
    model = LlamaForCausalLMEagle3(draft_config, attention_backend="sdpa")
    report = warm_start_draft_model(model, str(folder), draft_config=draft_config, strategy="eagle3",
                                    allow_missing_embedding=True)
    assert report.checkpoint_format == "pretrained" and not report.loaded_embedding
    assert torch.equal(model.fc.weight, tiny_drafter.fc.weight) and torch.equal(model.d2t, tiny_drafter.d2t)


FAKE_TRAIN = """
import json, sys
from pathlib import Path
from specforge.config import load_config
cfg = load_config(sys.argv[1], [])
assert any(Path(cfg.data.hidden_states_path).glob("rows_0-2000/data_0.ckpt"))
assert Path(cfg.model.vocab_mapping_path).is_file()
assert (Path(cfg.model.draft_checkpoint_path) / "model.safetensors").is_file()
step = Path(cfg.output_dir) / f"{cfg.run_id}-step6"
step.mkdir(parents=True)
(step / "training_state.pt").write_bytes(b"a pickle TIDE must never read")
"""
FAKE_EXPORT = """
import shutil, sys
from pathlib import Path
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
assert (Path(args["--checkpoint"]) / "training_state.pt").is_file()
out = Path(args["--output-dir"]); out.mkdir()
shutil.copy(args["--draft-config"], out / "config.json")  # what save_pretrained writes, weights unchanged
shutil.copy(Path(args["--draft-config"]).parent / "model.safetensors", out / "model.safetensors")
"""


def test_train_specforge_wires_export_run_and_import(tiny_target, tiny_drafter, tmp_path, monkeypatch):
    """The orchestration with SpecForge's two commands replaced by stand-ins (no GPU here): the
    window and warm start reach the trainer, the exported folder comes back validated."""
    from types import SimpleNamespace

    from tide.models.tiny import tiny_llama_checkpoint
    from tide.train.capture_log import log_samples
    from tide.train.trainer import Sample
    from tide.train.window import WindowSpec, plan_window

    shape, g = tiny_target.shape, torch.Generator().manual_seed(0)
    samples = [Sample(tokens=torch.randint(0, shape.vocab_size, (20,), generator=g), loss_mask=torch.ones(20),
                      aux=torch.randn(20, 3 * shape.hidden_size, generator=g),
                      final=torch.randn(20, shape.hidden_size, generator=g)) for _ in range(12)]
    data_dir = tmp_path / "dataset"
    log_samples(data_dir, samples, [5] * len(samples), target_model_id="org/m", aux_layer_ids=(1, 2, 3),
                start_s=1_700_000_000.0, id_prefix="r", max_message_bytes=8000)
    plan = plan_window(data_dir, WindowSpec(heldout_fraction=0.2, target_model="org/m"))
    target_folder = tiny_llama_checkpoint(tmp_path / "target")
    cfg = load_config(env={}, overrides={"home": str(tmp_path / "home"), "model": {"target": str(target_folder)},
                                         "train": {"backend": "specforge", "max_train_s": 120, "epochs": 2}})
    for name, body in (("train.py", FAKE_TRAIN), ("export.py", FAKE_EXPORT)):
        (tmp_path / name).write_text(body)
    monkeypatch.setattr(sb, "require", lambda world=1: None)
    monkeypatch.setattr(sb, "train_command", lambda layout: [sys.executable, str(tmp_path / "train.py"),
                                                             str(layout.config)])
    real_export = sb.export_command
    monkeypatch.setattr(sb, "export_command", lambda layout, ckpt: [sys.executable, str(tmp_path / "export.py")]
                        + real_export(layout, ckpt)[6:])
    inputs = SimpleNamespace(plan=plan, champion=tiny_drafter, vocab=mapping_digest(tiny_drafter.d2t),
                             target=SimpleNamespace(shape=shape, aux_layer_ids=tiny_target.aux_layer_ids))
    candidate, result = sb.train_specforge(cfg, inputs, tmp_path / "work", data_dir)
    assert result.steps == 6 and result.tokens_seen == 2 * 20 * len(plan.train_ids) and result.wall_s > 0
    assert torch.equal(candidate.fc.weight, tiny_drafter.fc.weight) and torch.equal(candidate.d2t, tiny_drafter.d2t)
    run = json.loads((tmp_path / "work" / "specforge" / "run.json").read_text())
    assert run["model"]["target_model_path"] == str(target_folder)
