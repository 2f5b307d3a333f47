"""Fixtures for fast unit tests: tiny random models built in code, one torch thread."""
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    from tide.models.llama import LlamaTarget
    from tide.models.tiny import tiny_llama_checkpoint

    folder = tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny") / "target")
    return LlamaTarget.from_folder(folder, aux_layer_ids=(1, 2, 3), max_seq_len=256)


@pytest.fixture(scope="session")
def tiny_drafter(tiny_target):
    from tide.train.offline import new_drafter

    counts = torch.arange(tiny_target.shape.vocab_size).flip(0)
    drafter = new_drafter(tiny_target, tiny_target.shape.vocab_size // 2, counts, seed=1)
    return drafter.eval()
