"""What a retrain loads of the target (tide.models.target.load_target_heads): exactly the
embeddings, lm_head, shape and capture layers the full target has, tied or not."""
from __future__ import annotations

import pytest
import torch

from tide.config import ModelConfig, TideConfig
from tide.models.llama import LlamaTarget
from tide.models.target import load_target_heads
from tide.models.tiny import tiny_llama_checkpoint


@pytest.mark.parametrize("tied", [True, False])
def test_heads_equal_the_full_targets(tmp_path, tied):
    folder = tiny_llama_checkpoint(tmp_path / "target", tie_embeddings=tied, layers=6)
    full = LlamaTarget.from_folder(folder)
    cfg = TideConfig(home=str(tmp_path / "home"), model=ModelConfig(target=str(folder), torch_threads=1))
    heads = load_target_heads(cfg)
    assert heads.shape == full.shape and heads.aux_layer_ids == full.aux_layer_ids
    assert torch.equal(heads.embed_weight, full.embed_weight)
    assert torch.equal(heads.lm_head_weight, full.lm_head_weight)
    assert (heads.lm_head_weight is heads.embed_weight) == tied
    chosen = TideConfig(home=str(tmp_path / "home"), model=ModelConfig(target=str(folder), aux_layer_ids=(1, 2, 4)))
    assert load_target_heads(chosen).aux_layer_ids == (1, 2, 4)
