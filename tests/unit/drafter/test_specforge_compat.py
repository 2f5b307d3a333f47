"""A drafter saved by TIDE loads into SpecForge's own LlamaForCausalLMEagle3 and computes the same logits.

SpecForge 0.2.0 is installed with --no-deps (scripts/install.sh); its torch.compile decorators are
disabled here because they need a compiler toolchain at import-time use on CPU.
"""
import json
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from tide.drafter.artifact import load_drafter, save_drafter  # noqa: E402
from tide.train.objective import Batch, unroll  # noqa: E402

sf_eagle = pytest.importorskip("specforge.modeling.draft.llama3_eagle",
                               reason="specforge must be installed (scripts/install.sh)")


@pytest.fixture(scope="module")
def pair(tiny_drafter, tmp_path_factory):
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    folder = save_drafter(tiny_drafter, tmp_path_factory.mktemp("d") / "drafter")
    cfg = LlamaConfig(**json.loads((folder / "config.json").read_text()))
    sf = sf_eagle.LlamaForCausalLMEagle3(cfg, attention_backend="sdpa")
    state = load_file(str(folder / "model.safetensors"))
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    state["embed_tokens.weight"] = embed
    sf.load_state_dict(state, strict=True)
    return load_drafter(folder), sf.eval(), embed


def _sf_mask(sf, h):
    b, t = h.shape[:2]
    return sf.prepare_decoder_attention_mask(torch.ones(b, t, dtype=torch.bool), h, b, t, 0)


def test_same_logits_as_specforge(pair):
    ours, sf, embed = pair
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 11, 3 * ours.shape.target_hidden_size, generator=g)
    ids = torch.randint(0, ours.shape.vocab_size, (2, 11), generator=g)
    with torch.no_grad():
        h = sf.project_hidden_states(aux)
        out = sf.backbone(sf.embed_input_ids(ids), h, None, _sf_mask(sf, h), torch.arange(11)[None].expand(2, 11))
        ref = sf.compute_logits(out)
        mine = ours.logits(ours.causal_forward(F.embedding(ids, embed), ours.project(aux)))
    assert torch.allclose(ref, mine, atol=1e-5), (ref - mine).abs().max()


def test_ttt_unroll_matches_specforge_cache_hidden(pair):
    from specforge.utils import padding

    ours, sf, embed = pair
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(2, 9, 3 * ours.shape.target_hidden_size, generator=g)
    ids = torch.randint(0, ours.shape.vocab_size, (2, 9), generator=g)
    # a partial loss mask: our unroll computes steps >= 1 only where a draft can reach it
    loss_mask = torch.zeros(2, 9)
    loss_mask[0, 6:] = 1
    loss_mask[1, 2:4] = 1
    batch = Batch(tokens=ids, aux=aux, final=torch.zeros(2, 9, ours.shape.hidden_size),
                  loss_mask=loss_mask, in_vocab=torch.ones(2, 9, dtype=torch.bool))
    with torch.no_grad():
        cache_hidden, h, cur, refs = [[], []], sf.project_hidden_states(aux), padding(ids, left=False), []
        mask = _sf_mask(sf, h)
        for _ in range(3):
            h = sf.backbone(sf.embed_input_ids(cur), h, cache_hidden, mask, torch.arange(9)[None].expand(2, 9))
            refs.append(sf.compute_logits(h))
            cur = padding(cur, left=False)
        for step, logits, rows in unroll(ours, embed, batch, 3):
            assert 0 < rows.t.numel() < 2 * 9
            ref = refs[step][rows.b, rows.t]
            assert torch.allclose(logits, ref, atol=1e-5), (step, (logits - ref).abs().max())
