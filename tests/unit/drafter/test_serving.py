"""The serving copy of a drafter: same draft tokens, bf16 weights where exact, original untouched."""
import torch
from torch import nn

from tide.drafter.artifact import TargetSpec, load_drafter, save_drafter
from tide.drafter.model import RowLinear, for_serving
from tide.models.rowkernel import load
from tide.spec.generate import generate


def _spec(t):
    return TargetSpec(t.shape.hidden_size, t.shape.vocab_size, t.aux_layer_ids)


def test_served_copy_matches_and_leaves_the_original(tiny_target, tiny_drafter, tmp_path):
    if load() is None:  # no AVX2 / compiler: serving is the drafter itself
        assert for_serving(tiny_drafter) is tiny_drafter
        return
    # a saved artifact is bf16: its loaded weights are bf16-exact, so serving keeps them in bf16
    loaded = load_drafter(save_drafter(tiny_drafter, tmp_path / "d", dtype=torch.bfloat16), _spec(tiny_target))
    served = for_serving(loaded)
    assert served is not loaded and for_serving(served) is served
    assert isinstance(loaded.lm_head, nn.Linear) and isinstance(served.lm_head, RowLinear)
    assert served.lm_head.wk.dtype == torch.bfloat16 and served.midlayer.mlp.down_proj.wk.dtype == torch.bfloat16
    assert torch.equal(served.lm_head.weight, loaded.lm_head.weight)
    # a drafter built in code is not bf16-valued: its kernel weights stay float32
    assert for_serving(tiny_drafter).fc.wk.dtype == torch.float32

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, tiny_target.shape.hidden_size, generator=g)
    for x in (h[:, :1], h, torch.randn(4, 9, h.shape[-1], generator=g)):  # 2, 6, 36 rows: kernel and GEMM paths
        assert torch.allclose(served.logits(x), loaded.logits(x), atol=1e-4)
    prompt = list(range(3, 40))
    with torch.no_grad():
        a, _ = generate(tiny_target, loaded, prompt, 24, gamma=3)
        b, _ = generate(tiny_target, served, prompt, 24, gamma=3)
        c, _ = generate(tiny_target, None, prompt, 24)
    assert a == b == c  # lossless either way; same draft tokens for this prompt


def test_served_copy_has_the_same_state_dict(tiny_target, tiny_drafter, tmp_path):
    """Operators compare and export the drafter the engine serves: same keys, same values."""
    loaded = load_drafter(save_drafter(tiny_drafter, tmp_path / "s", dtype=torch.bfloat16), _spec(tiny_target))
    ref, got = loaded.state_dict(), for_serving(loaded).state_dict()
    assert list(got) == list(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
