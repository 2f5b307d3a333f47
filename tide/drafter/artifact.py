"""Drafter artifacts: the SpecForge/SGLang export layout, saved and loaded with validation.

A drafter folder holds ``config.json`` (architecture ``LlamaForCausalLMEagle3``),
``model.safetensors`` (fc, midlayer, norm, lm_head, t2d, d2t; no embeddings), ``tide.json``
(sha256 of the weights file, vocab-mapping digest, free-form lineage metadata) and, optionally,
``confidence/`` (the calibrated confidence head, its sha256 in tide.json; tide/drafter/confidence.py).

Loading steps (anything wrong raises ``DrafterError`` and nothing is returned):
1. refuse folders carrying pickle weights (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) or missing files;
2. check the sha256 recorded in tide.json (if present, or if ``require_checksum``);
3. read config.json and bound every size in it before anything is allocated, then check it
   against the target (hidden size, vocab, aux layer ids, positions; tide/drafter/bounds.py);
4. compare the safetensors header's names and shapes with the module's (no tensor read yet);
5. load tensors with safetensors only, check finite values and the vocab mapping (and, if given,
   that it equals the serving one), build the module;
6. load the confidence head if the folder has one (checksum, shapes, finite, positive temperatures).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tide.drafter.bounds import LIMITS, config_problems, expected_state, fit_problems, header_problems
from tide.drafter.confidence import CONFIDENCE_SHA, load_confidence, save_confidence
from tide.drafter.model import DrafterShape, Eagle3Drafter
from tide.drafter.vocab import mapping_digest

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
META = "tide.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class DrafterError(ValueError):
    """A drafter artifact was refused; the message says why."""


@dataclass(frozen=True)
class TargetSpec:
    """What a drafter must match to serve a target."""

    hidden_size: int
    vocab_size: int
    aux_layer_ids: tuple[int, ...]
    max_positions: int = 0  # positions the engine feeds a drafter (its max_seq_len); 0 = unchecked


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def round_weights_(drafter: Eagle3Drafter, dtype: torch.dtype) -> Eagle3Drafter:
    """Round floating parameters to ``dtype`` in place (kept in their own dtype): what a drafter
    saved with ``save_drafter(..., dtype=dtype)`` will load back as, bit for bit."""
    with torch.no_grad():
        for p in drafter.parameters():
            if p.is_floating_point():
                p.copy_(p.to(dtype).to(p.dtype))
    return drafter


def save_drafter(drafter: Eagle3Drafter, folder: str | Path, metadata: dict | None = None,
                 dtype: torch.dtype | None = None) -> Path:
    """Write the export layout atomically (temp folder + rename); returns the folder.

    ``dtype`` (e.g. bfloat16) casts floating weights for a smaller artifact; loading casts back.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        state = {k: v.detach().contiguous().clone() for k, v in drafter.state_dict().items()}
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        extra = {"torch_dtype": str(dtype).removeprefix("torch.")} if dtype is not None else None
        (tmp / CONFIG).write_text(json.dumps(drafter.shape.to_hf_config(extra), indent=2))
        meta = {"sha256": file_sha256(tmp / WEIGHTS), "vocab_mapping": mapping_digest(drafter.d2t),
                **(metadata or {})}
        if drafter.confidence is not None:
            meta[CONFIDENCE_SHA] = save_confidence(drafter.confidence, tmp)
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True))
        for p in (p for p in tmp.rglob("*") if p.is_file()):
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _read_json(path: Path) -> object:
    if path.stat().st_size > LIMITS.config_bytes:
        raise DrafterError(f"{path}: larger than {LIMITS.config_bytes} bytes")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise DrafterError(f"{path}: not JSON ({exc})") from exc


def read_metadata(folder: str | Path) -> dict:
    path = Path(folder) / META
    if not path.exists():
        return {}
    meta = _read_json(path)
    if not isinstance(meta, dict):
        raise DrafterError(f"{path}: must hold a JSON object")
    return meta


def read_shape(folder: str | Path) -> DrafterShape:
    """config.json parsed and bounded (tide/drafter/bounds.py); nothing is allocated from it."""
    path = Path(folder) / CONFIG
    cfg = _read_json(path)
    if not isinstance(cfg, dict):
        raise DrafterError(f"{path}: must hold a JSON object")
    try:
        shape = DrafterShape.from_hf_config(cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise DrafterError(f"{path}: {type(exc).__name__}: {exc}") from exc
    problems = config_problems(shape)
    if problems:
        raise DrafterError(f"{path}: " + "; ".join(problems))
    return shape


def _load_weights(folder: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The tensors, once the header shows exactly ``expected`` (names and shapes)."""
    try:
        problems = header_problems(folder / WEIGHTS, expected)
        state = None if problems else load_file(str(folder / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as exc:
        raise DrafterError(f"{folder}/{WEIGHTS}: unreadable safetensors ({exc})") from exc
    if problems:
        raise DrafterError(f"{folder}: " + "; ".join(problems))
    return state


def load_drafter(folder: str | Path, target: TargetSpec | None = None,
                 expect_vocab_mapping: str | None = None, require_checksum: bool = False) -> Eagle3Drafter:
    folder = Path(folder)
    if not folder.is_dir():
        raise DrafterError(f"{folder}: not a drafter folder")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise DrafterError(f"{folder}: refusing pickle weights {pickles}; drafters load from safetensors only")
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise DrafterError(f"{folder}: missing {name}")
    meta = read_metadata(folder)
    if "sha256" in meta or require_checksum:
        actual = file_sha256(folder / WEIGHTS)
        if meta.get("sha256") != actual:
            raise DrafterError(f"{folder}: checksum mismatch (recorded {meta.get('sha256')}, actual {actual})")
    shape = read_shape(folder)
    if target is not None:
        problems = fit_problems(shape, target)
        if problems:
            raise DrafterError(f"{folder}: does not fit the target: " + "; ".join(problems))
    expected = expected_state(shape)
    state = _load_weights(folder, expected)
    for name, t in state.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise DrafterError(f"{folder}: {name} has non-finite values")
    d2t = state["d2t"].to(torch.int64)
    target_ids = torch.arange(shape.draft_vocab_size) + d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= shape.vocab_size or \
            target_ids.unique().numel() != shape.draft_vocab_size:
        raise DrafterError(f"{folder}: d2t does not map draft ids to distinct target ids")
    t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    if not torch.equal(t2d, state["t2d"].to(torch.bool)):
        raise DrafterError(f"{folder}: t2d is inconsistent with d2t")
    if expect_vocab_mapping is not None and mapping_digest(d2t) != expect_vocab_mapping:
        raise DrafterError(f"{folder}: vocab mapping {mapping_digest(d2t)} differs from the serving "
                           f"mapping {expect_vocab_mapping}; the draft vocab must stay fixed")
    drafter = Eagle3Drafter(shape)
    dtypes = {k: v.dtype for k, v in drafter.state_dict().items()}
    state = {k: v for k, v in state.items() if k in expected}
    state["t2d"] = state["t2d"].to(torch.bool)
    drafter.load_state_dict({k: v.to(dtypes[k]) for k, v in state.items()})
    try:
        drafter.confidence = load_confidence(folder, shape.hidden_size, meta.get(CONFIDENCE_SHA))
    except (SafetensorError, OSError, ValueError) as exc:
        raise DrafterError(f"{folder}: confidence head: {exc}") from exc
    return drafter.eval()
