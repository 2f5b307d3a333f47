"""Loading the target for any component: checkpoint (converted once, cached), tokenizer, EOS ids.

Shared by the engine and by training, which must not import each other.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tide.models.llama import LlamaTarget


def load_target(cfg) -> tuple[LlamaTarget, object, Path]:
    """Target checkpoint (converted once and cached), tokenizer, and the checkpoint folder."""
    from transformers import AutoTokenizer

    from tide.models.checkpoint import ensure_target_checkpoint

    torch.set_num_threads(cfg.model.torch_threads)
    folder = ensure_target_checkpoint(cfg.home_path, cfg.model.target)
    dtype = getattr(torch, cfg.model.dtype)
    target = LlamaTarget.from_folder(folder, cfg.model.aux_layer_ids, dtype, cfg.model.max_seq_len)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return target, tokenizer, folder


def eos_ids_of(tokenizer, folder: Path) -> tuple[int, ...]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))
