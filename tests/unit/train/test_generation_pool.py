"""Sharded self-generation: worker processes give exactly the samples one process gives, in order."""
import pytest
import torch

from tide.train.generation_pool import TargetSource, generate_sharded, load_samples, save_samples, shard_bounds
from tide.train.offline import generate_samples


@pytest.mark.parametrize("n,workers,batch", [(10, 2, 3), (7, 2, 8), (32, 3, 4), (5, 8, 1), (1, 2, 4)])
def test_shards_cover_the_prompts_in_whole_batches(n, workers, batch):
    bounds = shard_bounds(n, workers, batch)
    assert len(bounds) <= workers
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds)
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(bounds, bounds[1:]))  # contiguous, no overlap
    assert all(a % batch == 0 for a, _ in bounds)  # each shard starts a batch of the one-process run


def test_no_prompts_no_shards():
    assert shard_bounds(0, 2, 4) == []


def test_sharded_generation_equals_one_process(tmp_path):
    from tide.models.llama import LlamaTarget
    from tide.models.tiny import tiny_llama_checkpoint

    folder = tiny_llama_checkpoint(tmp_path / "target")
    source = TargetSource(str(folder), (1, 2, 3), "float32", 256)
    target = LlamaTarget.from_folder(folder, source.aux_layer_ids, torch.float32, source.max_seq_len)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.shape.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 20, (7,), generator=g)]
    eos = (2,)
    one = generate_samples(target, prompts, 12, eos, batch_size=3, progress=False)
    sharded = generate_sharded(source, prompts, 12, eos, batch_size=3, workers=2, scratch=tmp_path / "scratch")
    assert len(sharded) == len(one) == len(prompts)
    for a, b in zip(one, sharded):
        assert torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.aux, b.aux) and torch.equal(a.final, b.final)
    assert not list((tmp_path / "scratch").iterdir())  # shard files are removed


def test_samples_file_round_trip(tmp_path):
    from tide.train.trainer import Sample

    g = torch.Generator().manual_seed(1)
    samples = [Sample(tokens=torch.randint(0, 50, (n,), generator=g), loss_mask=(torch.arange(n) >= 2).float(),
                      aux=torch.randn(n, 12, generator=g).bfloat16(), final=torch.randn(n, 4, generator=g).bfloat16())
               for n in (3, 5, 11)]
    save_samples(samples, tmp_path / "s.safetensors")
    back = load_samples(tmp_path / "s.safetensors")
    assert [len(s) for s in back] == [3, 5, 11]
    for a, b in zip(samples, back):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.aux, b.aux) and torch.equal(a.final, b.final)
        assert torch.equal(a.loss_mask, b.loss_mask)
        assert b.target_top is None  # not computed yet: the trainer fills it
    samples[1].target_top = torch.arange(5)  # the trainer's argmax travels with the samples once computed
    save_samples(samples, tmp_path / "t.safetensors")
    back = load_samples(tmp_path / "t.safetensors")
    assert back[0].target_top is None and torch.equal(back[1].target_top, torch.arange(5))


def test_a_bad_recipe_is_refused_when_made():
    from tide.train.static import StaticRecipe

    with pytest.raises(ValueError, match="precision"):
        StaticRecipe(precision="fp16")
    with pytest.raises(ValueError, match="generation_workers"):
        StaticRecipe(generation_workers=0)
    with pytest.raises(ValueError, match="train_ranks"):
        StaticRecipe(train_ranks=0)
    with pytest.raises(ValueError, match="generation_chunk"):
        StaticRecipe(generation_batch=32, generation_chunk=100)  # a batch would straddle two chunks
    assert StaticRecipe(precision="auto", generation_workers=2).generation_workers == 2


def test_cache_chunks_have_fixed_bounds_so_a_larger_recipe_reuses_a_smaller_ones():
    from tide.train.static import generation_chunks

    assert generation_chunks(2000, 800) == [(0, 800), (800, 1600), (1600, 2000)]
    assert generation_chunks(5600, 800)[:4] == generation_chunks(3200, 800)
    assert generation_chunks(0, 800) == []
