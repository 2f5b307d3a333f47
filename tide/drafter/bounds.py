"""Bounds on a drafter's config.json and weights file, checked before anything is allocated.

A drafter folder may come from a registry that anyone with write access could fill, and the
sizes in its config.json decide how much memory ``Eagle3Drafter(shape)`` allocates. So
``load_drafter`` refuses (``DrafterError``) before building anything when:
1. ``config_problems``: a field has the wrong type (ints must be ints, not bools, floats or
   strings) or lies outside ``LIMITS``; the fields disagree with each other (kv heads divide the
   heads, RoPE needs an even head_dim, the draft vocab fits in the vocab, ``fc`` reads exactly
   three aux layers); or, given a target, they do not fit it (hidden size, vocab, aux layers, and
   positions covering every position the engine feeds a drafter);
2. ``header_problems``: the safetensors header (names and shapes, read without loading a tensor)
   differs from the state the module would have, computed on the meta device (no memory). The
   weights are loaded only when the file holds exactly what the config describes, so memory is
   bounded by the (checksummed) file's size, plus the RoPE tables bounded by ``LIMITS``.
Extending the drafter (e.g. an optional extra head): give its config fields a range in
``INT_FIELDS`` (or a rule in ``RULES``); its tensors join the meta-built state by themselves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tide.drafter.model import DrafterShape, Eagle3Drafter

NUM_AUX_LAYERS = 3  # fc reads the concatenation of three target layers' states (3H -> H)


@dataclass(frozen=True)
class Limits:
    """Largest values accepted from a config.json (beyond today's largest open models)."""

    hidden_size: int = 1 << 16
    intermediate_size: int = 1 << 18
    num_heads: int = 1 << 10
    head_dim: int = 1 << 10
    vocab_size: int = 1 << 21
    max_position_embeddings: int = 1 << 20
    aux_layer_id: int = 1 << 10
    # the RoPE tables are not in the weights file: (positions + 64) x head_dim floats, twice
    rope_elements: int = 1 << 27
    config_bytes: int = 1 << 20  # config.json and tide.json are read whole


LIMITS = Limits()

# field -> (lowest, highest): the ints of DrafterShape
INT_FIELDS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, LIMITS.hidden_size),
    "target_hidden_size": (1, LIMITS.hidden_size),
    "intermediate_size": (1, LIMITS.intermediate_size),
    "num_heads": (1, LIMITS.num_heads),
    "num_kv_heads": (1, LIMITS.num_heads),
    "head_dim": (2, LIMITS.head_dim),
    "vocab_size": (1, LIMITS.vocab_size),
    "draft_vocab_size": (1, LIMITS.vocab_size),
    "max_position_embeddings": (1, LIMITS.max_position_embeddings),
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ranges(s: DrafterShape) -> list[str]:
    out = []
    for name, (low, high) in INT_FIELDS.items():
        value = getattr(s, name)
        if not _is_int(value):
            out.append(f"{name} must be an integer, got {value!r}")
        elif not low <= value <= high:
            out.append(f"{name} {value} outside {low}..{high}")
    for name, high in (("rms_norm_eps", 1.0), ("rope_theta", 1e12)):
        value = getattr(s, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                or not 0 < value < high:
            out.append(f"{name} must be a finite number in (0, {high:g}), got {value!r}")
    aux = s.aux_layer_ids
    if len(aux) != NUM_AUX_LAYERS or not all(_is_int(i) and 0 <= i <= LIMITS.aux_layer_id for i in aux):
        out.append(f"aux layer ids must be {NUM_AUX_LAYERS} integers in 0..{LIMITS.aux_layer_id}, got {list(aux)!r}")
    if not isinstance(s.fc_norm, bool):
        out.append(f"fc_norm must be true or false, got {s.fc_norm!r}")
    return out


def _consistency(s: DrafterShape) -> list[str]:
    out = []
    if s.num_heads % s.num_kv_heads:
        out.append(f"num_attention_heads {s.num_heads} is not a multiple of num_key_value_heads {s.num_kv_heads}")
    if s.head_dim % 2:
        out.append(f"head_dim {s.head_dim} must be even (rotary embedding halves)")
    if s.draft_vocab_size > s.vocab_size:
        out.append(f"draft_vocab_size {s.draft_vocab_size} exceeds vocab_size {s.vocab_size}")
    if (s.max_position_embeddings + 64) * s.head_dim > LIMITS.rope_elements:
        out.append(f"max_position_embeddings {s.max_position_embeddings} x head_dim {s.head_dim} exceeds "
                   f"the RoPE table limit ({LIMITS.rope_elements} elements)")
    return out


# run in order once the ranges hold (they may divide by or compare fields)
RULES: list[Callable[[DrafterShape], list[str]]] = [_consistency]


def config_problems(shape: DrafterShape) -> list[str]:
    """What is wrong with the config on its own (empty when nothing)."""
    problems = _ranges(shape)
    if problems:
        return problems
    for rule in RULES:
        problems += rule(shape)
    return problems


def fit_problems(shape: DrafterShape, target) -> list[str]:
    """What does not fit ``target`` (a tide.drafter.artifact.TargetSpec)."""
    problems = []
    if shape.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {shape.target_hidden_size} != target's {target.hidden_size}")
    if shape.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {shape.hidden_size} != target's {target.hidden_size} "
                        "(embeddings are shared with the target)")
    if shape.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {shape.vocab_size} != target's {target.vocab_size}")
    if tuple(shape.aux_layer_ids) != tuple(target.aux_layer_ids):
        problems.append(f"aux layers {shape.aux_layer_ids} != target capture layers {target.aux_layer_ids}")
    if target.max_positions and shape.max_position_embeddings < target.max_positions:
        problems.append(f"max_position_embeddings {shape.max_position_embeddings} < the engine's "
                        f"{target.max_positions} positions")
    return problems


def expected_state(shape: DrafterShape) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the module's saved state, built on the meta device (no memory)."""
    with torch.device("meta"):
        module = Eagle3Drafter(shape)
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


def header_problems(weights: Path, expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Names and shapes in the safetensors header against ``expected``; no tensor is read."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    found.pop("embed_tokens.weight", None)  # some exports carry the target's embeddings
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        return [f"tensor names differ (missing {missing}, unexpected {unexpected[:20]})"]
    return [f"{name} has shape {found[name]}, expected {shape}"
            for name, shape in expected.items() if found[name] != shape]
