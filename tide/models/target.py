"""Loading the target for any component: checkpoint (converted once, cached), tokenizer, EOS ids.

Shared by the engine and by training, which must not import each other.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tide.models.llama import LlamaShape, LlamaTarget, default_aux_layer_ids


def load_target(cfg) -> tuple[LlamaTarget, object, Path]:
    """Target checkpoint (converted once and cached), tokenizer, and the checkpoint folder."""
    from transformers import AutoTokenizer

    from tide.models.checkpoint import ensure_target_checkpoint

    torch.set_num_threads(cfg.model.torch_threads)
    folder = ensure_target_checkpoint(cfg.home_path, cfg.model.target)
    dtype = getattr(torch, cfg.model.dtype)
    target = LlamaTarget.from_folder(folder, cfg.model.aux_layer_ids, dtype, cfg.model.max_seq_len,
                                     kernel=cfg.model.linear_kernel)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return target, tokenizer, folder


@dataclass(frozen=True)
class TargetHeads:
    """What drafter training reads of the target: its shape, capture layers, embeddings and lm_head
    (the same tensor when tied). The layers are never run in training, so they are never loaded."""

    shape: LlamaShape
    aux_layer_ids: tuple[int, ...]
    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor


def load_target_heads(cfg) -> TargetHeads:
    """The target's embeddings and lm_head only (in ``model.dtype``, as ``load_target`` has them)."""
    from safetensors import safe_open

    from tide.models.checkpoint import ensure_target_checkpoint

    torch.set_num_threads(cfg.model.torch_threads)
    folder = ensure_target_checkpoint(cfg.home_path, cfg.model.target)
    shape = LlamaShape.from_hf_config(json.loads((folder / "config.json").read_text()))
    dtype = getattr(torch, cfg.model.dtype)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = {k.removeprefix("model."): k for k in f.keys()}
        embed = f.get_tensor(names["embed_tokens.weight"]).to(dtype)
        if "lm_head.weight" in names:
            head = f.get_tensor(names["lm_head.weight"]).to(dtype)
        elif shape.tie_word_embeddings:
            head = embed
        else:
            raise ValueError("checkpoint has no lm_head.weight and does not tie embeddings")
    aux = tuple(cfg.model.aux_layer_ids) or default_aux_layer_ids(shape.num_layers)
    return TargetHeads(shape, aux, embed, head)


def eos_ids_of(tokenizer, folder: Path) -> tuple[int, ...]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))
