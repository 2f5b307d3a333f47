"""A TIDE drafter folder as the weights of SGLang's EAGLE3 draft model (``LlamaForCausalLMEagle3``).

The swap ships no weights through HTTP: ``update_weights_from_tensor`` (selector "draft") carries
one small manifest tensor (the folder, its weights' sha256 and the version), and the TIDE loader
named by ``--custom-weight-loader`` (``tide.engine.sglang.plugin.load_draft``) reads the folder in
each scheduler process and loads it into the draft model through the model's own
``load_weights``. Every check runs before a single parameter is written:
1. the folder passes TIDE's artifact checks (safetensors only, sha256, names, shapes, finite
   values, t2d consistent with d2t) and its sha256 is the manifest's;
2. its shape (hidden and intermediate sizes, heads, vocabularies, target hidden size, aux layers,
   fc_norm, norm eps, RoPE base) equals the serving draft model's config: SGLang sized the draft
   KV cache, the CUDA graphs and the target's capture layers for it at start;
3. its vocab mapping equals the serving one: SGLang reads ``hot_token_id`` (from d2t) once at
   start, so a new mapping would never take effect. ``t2d``/``d2t`` are not loaded.
Names stay SpecForge's (``midlayer.*``, ``fc``, ``norm``, ``lm_head``): ``load_weights`` maps
them (``midlayer`` -> ``layers.0``, q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``).
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tide.drafter.artifact import DrafterError, load_drafter, read_metadata
from tide.drafter.model import DrafterShape, Eagle3Drafter
from tide.drafter.vocab import mapping_digest

MANIFEST = "tide.manifest"  # the one tensor name a swap sends
FIXED = ("t2d", "d2t")  # the vocab mapping: fixed for the server's life
# shape fields compared; the rest of DrafterShape (max positions) does not change the weights' meaning
COMPARED = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
            "draft_vocab_size", "target_hidden_size", "aux_layer_ids", "fc_norm", "rms_norm_eps", "rope_theta")


def shape_of_config(cfg: dict) -> DrafterShape:
    """A drafter config dict (config.json, or ``model.config.to_dict()`` of SGLang's draft model)."""
    cfg = dict(cfg)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "rope_theta" not in cfg and isinstance(rope, dict) and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]  # transformers 5 folds rope_theta into rope_parameters
    try:
        return DrafterShape.from_hf_config(cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise DrafterError(f"drafter config: {exc}") from exc


def shape_problems(candidate: DrafterShape, serving: DrafterShape) -> list[str]:
    a, b = asdict(candidate), asdict(serving)
    return [f"{k} {a[k]} != serving {b[k]}" for k in COMPARED if a[k] != b[k]]


def prepare(folder: Path, serving: DrafterShape, serving_mapping: str, sha256: str | None = None) -> Eagle3Drafter:
    """Load and check a candidate off the serving path (steps 1-3 of the module docstring)."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise DrafterError(f"{folder}: not a drafter folder (no config.json)")
    problems = shape_problems(shape_of_config(json.loads(cfg_path.read_text())), serving)
    if problems:
        raise DrafterError(f"{folder}: does not fit the serving draft model: " + "; ".join(problems))
    drafter = load_drafter(folder, expect_vocab_mapping=serving_mapping, require_checksum=True)
    if sha256 is not None and read_metadata(folder).get("sha256") != sha256:
        raise DrafterError(f"{folder}: weights sha256 differs from the manifest's {sha256}")
    return drafter


def named_tensors(drafter: Eagle3Drafter, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    """What ``LlamaForCausalLMEagle3.load_weights`` receives: everything but the fixed mapping."""
    out = []
    for name, t in drafter.state_dict().items():
        if name in FIXED:
            continue
        t = t.detach()
        out.append((name, t.to(dtype) if dtype is not None and t.is_floating_point() else t))
    return out


def serving_mapping_of(model: Any) -> str:
    """The vocab mapping SGLang serves: d2t recovered from the draft model's ``hot_token_id``."""
    hot = model.get_hot_token_id()
    if hot is None:
        raise DrafterError("the serving draft model has no hot_token_id (no d2t was loaded)")
    hot = hot.detach().to("cpu", torch.int64)
    return mapping_digest(hot - torch.arange(hot.shape[0]))


def serving_shape_of(model: Any) -> DrafterShape:
    return shape_of_config(model.config.to_dict())


def load_into(model: Any, drafter: Eagle3Drafter) -> None:
    """Write the drafter's parameters into SGLang's draft model (in place, so the draft CUDA graphs
    captured at start stay valid)."""
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        model.load_weights(named_tensors(drafter, dtype))


def manifest(folder: Path, version: str) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one swap request: a uint8 tensor holding the manifest JSON."""
    body = {"folder": str(Path(folder).resolve()), "version": str(version),
            "sha256": read_metadata(folder).get("sha256")}
    data = json.dumps(body, sort_keys=True).encode()
    return [(MANIFEST, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


def read_manifest(named: list[tuple[str, Any]]) -> dict:
    found = [t for name, t in named if name == MANIFEST]
    if len(found) != 1 or len(named) != 1:
        raise DrafterError(f"expected exactly one {MANIFEST!r} tensor, got {[n for n, _ in named]}")
    body = json.loads(bytes(found[0].to("cpu", torch.uint8).tolist()).decode())
    if not {"folder", "version", "sha256"} <= set(body):
        raise DrafterError(f"manifest lacks folder/version/sha256: {sorted(body)}")
    return body
