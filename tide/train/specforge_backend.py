"""The optional SpecForge trainer (``train.backend: specforge``), for GPU images with SpecForge.

TIDE's own trainer (``tide/train/trainer.py``) stays the default; this backend hands the
training step of a retrain to SpecForge's EAGLE3 trainer and takes its result back through
TIDE's validation. Steps of ``train_specforge`` (all files under the retrain's work folder):
1. refuse to start unless SpecForge imports, a GPU is visible and the retrain is one process
   (SpecForge's Triton loss and flex-attention backward have no CPU path; it launches its own
   ranks), before anything is written;
2. write the champion as an HF-style folder (config.json + model.safetensors, TIDE's artifact
   layout, which SpecForge warm-starts from) and the window in SpecForge's offline format
   (``tide/train/specforge_export.py``) with the champion's vocab mapping, which SpecForge is
   told to load so the draft vocab stays fixed;
3. write a SpecForge run config (``train.*`` mapped onto it: lr, epochs, TTT length, batch) and
   run ``specforge train`` as a subprocess in its own process group, killed at
   ``train.max_train_s`` (SpecForge has no wall-time cap of its own);
4. SpecForge checkpoints are pickles (``training_state.pt``): TIDE never loads them. SpecForge's
   own exporter (``specforge export --to sglang``, a second subprocess) turns the final one into
   a config.json + model.safetensors folder, which ``import_checkpoint`` loads with
   ``load_drafter`` (target shape, finite values, safetensors only) and the champion's vocab
   mapping enforced. The caller evaluates and registers it as with TIDE's trainer.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tide.drafter.artifact import PICKLE_SUFFIXES, WEIGHTS, TargetSpec, load_drafter, save_drafter
from tide.drafter.model import Eagle3Drafter

log = logging.getLogger(__name__)

RUN_ID = "tide"  # SpecForge names its checkpoints <run_id>-step<N> and points <run_id>-latest at the last
KILL_GRACE_S = 30.0  # after SIGTERM, before SIGKILL: SpecForge unwinds its process group on SIGTERM
EXPORT_TIMEOUT_S = 600.0  # the export reads one checkpoint and writes one small drafter
VOCAB_MAPPING = Path("vocab_mapping") / "vocab_mapping.pt"  # inside the offline export


class SpecForgeError(RuntimeError):
    """The SpecForge backend cannot run here, or its run produced nothing TIDE accepts."""


def unavailable_reason() -> str:
    """Why the SpecForge backend cannot run in this process ('' when it can)."""
    import torch

    if importlib.util.find_spec("specforge") is None:
        return "SpecForge is not installed (it ships in the GPU training images: pip install specforge)"
    if not torch.cuda.is_available():
        return (f"no GPU is usable (torch {torch.__version__}, torch.cuda.is_available() is False); "
                f"SpecForge's Triton loss and flex-attention backward have no CPU path")
    return ""


def available() -> bool:
    return not unavailable_reason()


def require(world: int = 1) -> None:
    """Raise ``SpecForgeError`` unless this process can run SpecForge (checked before any work)."""
    reason = unavailable_reason()
    if not reason and world > 1:
        reason = f"the retrain runs as {world} torchrun ranks; SpecForge launches its own ranks (run one process)"
    if reason:
        raise SpecForgeError(f"train.backend is 'specforge' but {reason}")


@dataclass(frozen=True)
class Layout:
    """The files of one SpecForge run under the retrain's work folder."""

    root: Path

    @property
    def warm_start(self) -> Path:
        return self.root / "warm_start"

    @property
    def data(self) -> Path:
        return self.root / "offline_data"

    @property
    def output(self) -> Path:
        return self.root / "output"

    @property
    def config(self) -> Path:
        return self.root / "run.json"

    @property
    def exported(self) -> Path:
        return self.root / "exported"

    @property
    def log(self) -> Path:
        return self.root / "specforge.log"


def run_config(tc, layout: Layout, target_path: Path) -> dict:
    """SpecForge's typed run config (``specforge.config.Config``) for one offline EAGLE3 run.

    TIDE batches by padded tokens, SpecForge by sequences: batch_tokens // max_seq_len sequences
    of at most max_seq_len tokens. SpecForge weights its TTT steps itself (0.8 ** step), so
    ``train.step_weight_decay``, the loss-weight keys and ``train.anchor`` of TIDE's trainer do not
    apply here.
    """
    return {
        "model": {
            "target_model_path": str(target_path),  # the frozen embeddings and lm_head
            "draft_model_config": str(layout.warm_start / "config.json"),
            "draft_checkpoint_path": str(layout.warm_start),  # weights only: a warm start, not a resume
            "vocab_mapping_path": str(layout.data / VOCAB_MAPPING),  # else SpecForge derives a new one
        },
        "data": {"hidden_states_path": str(layout.data), "max_length": tc.max_seq_len,
                 "cache_dir": str(layout.root / "cache")},
        "training": {"strategy": "eagle3", "num_epochs": tc.epochs, "learning_rate": tc.lr,
                     "ttt_length": tc.ttt_length, "batch_size": max(1, tc.batch_tokens // tc.max_seq_len),
                     "seed": tc.seed, "save_interval": 0},  # 0: one checkpoint, at the end
        "run_id": RUN_ID,
        "output_dir": str(layout.output),
    }


def train_command(layout: Layout) -> list[str]:
    return [sys.executable, "-m", "specforge.cli", "train", "--config", str(layout.config)]


def export_command(layout: Layout, checkpoint: Path) -> list[str]:
    return [sys.executable, "-m", "specforge.cli", "export", "--to", "sglang",
            "--checkpoint", str(checkpoint), "--draft-config", str(layout.warm_start / "config.json"),
            "--output-dir", str(layout.exported), "--vocab-mapping", str(layout.data / VOCAB_MAPPING)]


def run_capped(what: str, cmd: list[str], log_path: Path, timeout_s: float, cwd: Path) -> None:
    """Run ``cmd`` in its own process group (SpecForge starts worker processes); kill the group
    at ``timeout_s`` or when this process unwinds (a retrain's SIGTERM)."""
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SpecForgeError(f"{what} ran past {timeout_s:.0f} s; log: {log_path}") from None
        finally:
            _kill_group(proc)
    if code != 0:
        raise SpecForgeError(f"{what} exited {code}; last lines of {log_path}:\n{_tail(log_path)}")


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def final_checkpoint(output: Path) -> tuple[Path, int]:
    """The last training checkpoint SpecForge wrote (its folder and step)."""
    steps = {}
    for path in output.glob(f"{RUN_ID}-step*"):
        match = re.fullmatch(rf"{RUN_ID}-step(\d+)", path.name)
        if match and path.is_dir():
            steps[int(match.group(1))] = path
    if not steps:
        raise SpecForgeError(f"{output}: SpecForge wrote no {RUN_ID}-step<N> checkpoint")
    step = max(steps)
    return steps[step], step


def import_checkpoint(folder: Path, target: TargetSpec, vocab_mapping: str) -> Eagle3Drafter:
    """A drafter folder written by SpecForge, through TIDE's validation: safetensors only (a
    pickle-only checkpoint is refused, never unpickled), the target's shape, the fixed vocab."""
    folder = Path(folder)
    if folder.is_dir() and not (folder / WEIGHTS).is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise SpecForgeError(f"{folder}: only pickle checkpoints {pickles}; TIDE imports {WEIGHTS} only "
                                 f"(export with `specforge export --to sglang`)")
    return load_drafter(folder, target, expect_vocab_mapping=vocab_mapping)


def train_specforge(cfg, inputs, work: Path, data_dir: Path):
    """Train a candidate from ``inputs.champion`` with SpecForge; returns (candidate, TrainResult).

    ``inputs`` is the online retrain's ``_Inputs`` (plan, champion, target, vocab digest).
    """
    from tide.models.checkpoint import ensure_target_checkpoint
    from tide.train.ranks import current_ranks
    from tide.train.specforge_export import export_specforge
    from tide.train.trainer import TrainResult

    require(current_ranks().world)
    tc, champion, layout = cfg.train, inputs.champion, Layout(Path(work) / "specforge")
    layout.root.mkdir(parents=True, exist_ok=True)
    save_drafter(champion, layout.warm_start)
    manifest = export_specforge(data_dir, inputs.plan, layout.data, champion.d2t, champion.t2d,
                                all_positions=tc.train_on_prompt, max_seq_len=tc.max_seq_len)
    target_path = ensure_target_checkpoint(cfg.home_path, cfg.model.target, progress=False)
    layout.config.write_text(json.dumps(run_config(tc, layout, target_path), indent=1))
    t0 = time.monotonic()
    log.info("retrain: SpecForge on %d samples (%d tokens); log %s", manifest["samples"], manifest["tokens"], layout.log)
    run_capped("specforge train (capped by train.max_train_s)", train_command(layout), layout.log,
               tc.max_train_s, layout.root)
    wall_s = time.monotonic() - t0
    checkpoint, step = final_checkpoint(layout.output)
    run_capped("specforge export", export_command(layout, checkpoint), layout.log, EXPORT_TIMEOUT_S, layout.root)
    spec = TargetSpec(inputs.target.shape.hidden_size, inputs.target.shape.vocab_size, inputs.target.aux_layer_ids)
    candidate = import_checkpoint(layout.exported, spec, inputs.vocab)
    # SpecForge reports no token count here: the planned passes over the exported tokens
    return candidate, TrainResult(steps=step, tokens_seen=manifest["tokens"] * tc.epochs, wall_s=wall_s)
