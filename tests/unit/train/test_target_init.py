"""Target init copies the right rows and layer: the copied mid layer computes the target's layer."""
import pytest
import torch

from tide.models.llama import rms_norm
from tide.train.offline import new_drafter
from tide.train.target_init import init_from_target, mlp_channels, resolve_layer


def _drafter(target, intermediate=None, seed=3):
    counts = torch.arange(target.shape.vocab_size) % 7
    return new_drafter(target, target.shape.vocab_size // 2, counts, intermediate, seed=seed)


def test_copies_head_rows_norm_and_the_chosen_layer(tiny_target):
    drafter = _drafter(tiny_target)
    fresh = {k: v.clone() for k, v in drafter.state_dict().items()}
    init_from_target(drafter, tiny_target, layer=-1)
    w, h, last = tiny_target.w, tiny_target.shape.hidden_size, tiny_target.shape.num_layers - 1
    mid = drafter.midlayer
    assert torch.equal(drafter.lm_head.weight, w["lm_head.weight"][drafter.draft_to_target])
    assert torch.equal(drafter.norm.weight, w["norm.weight"])
    assert torch.equal(mid.hidden_norm.weight, w[f"layers.{last}.input_layernorm.weight"])
    for name in "qkv":
        proj = getattr(mid.self_attn, f"{name}_proj").weight
        assert torch.equal(proj[:, h:], w[f"layers.{last}.self_attn.{name}_proj.weight"])
        # the embedding half has no counterpart in the target: left as initialised
        assert torch.equal(proj[:, :h], fresh[f"midlayer.self_attn.{name}_proj.weight"][:, :h])
    assert torch.equal(mid.mlp.down_proj.weight, w[f"layers.{last}.mlp.down_proj.weight"])
    assert torch.equal(drafter.fc.weight, fresh["fc.weight"])  # fc learns the map into the layer
    # another layer id copies another layer
    init_from_target(drafter, tiny_target, layer=0)
    assert torch.equal(mid.self_attn.o_proj.weight, w["layers.0.self_attn.o_proj.weight"])
    assert not torch.equal(mid.self_attn.o_proj.weight, w[f"layers.{last}.self_attn.o_proj.weight"])


def test_copied_layer_reproduces_the_targets_last_layer(tiny_target):
    """Fed the target's last-layer input (an aux chunk) with the embedding half silenced, the drafter's
    normed output is the target's final state: the copy is the layer's function, not just its numbers."""
    assert tiny_target.aux_layer_ids[-1] == tiny_target.shape.num_layers - 1
    drafter = _drafter(tiny_target)
    init_from_target(drafter, tiny_target, layer=-1)
    h = tiny_target.shape.hidden_size
    with torch.no_grad():
        for name in "qkv":
            getattr(drafter.midlayer.self_attn, f"{name}_proj").weight[:, :h] = 0.0
    ids = torch.randint(3, tiny_target.shape.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    cache = tiny_target.new_cache(2, 32)
    out = tiny_target.forward(ids, torch.zeros(2, dtype=torch.long), cache, torch.arange(2))
    layer_input = out.aux_hidden[..., 2 * h:]
    with torch.no_grad():
        hidden = drafter.causal_forward(torch.zeros_like(layer_input), layer_input)
        normed = rms_norm(hidden, drafter.norm.weight, drafter.shape.rms_norm_eps)
    torch.testing.assert_close(normed, out.final_hidden, rtol=1e-4, atol=1e-4)


def test_narrower_mlp_keeps_the_strongest_channels(tiny_target):
    full = tiny_target.shape.intermediate_size
    drafter = _drafter(tiny_target, intermediate=full // 2)
    init_from_target(drafter, tiny_target, layer=1)
    w = tiny_target.w
    gate, up, down = (w[f"layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    score = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
    keep = torch.sort(torch.topk(score, full // 2).indices).values
    assert torch.equal(drafter.midlayer.mlp.gate_proj.weight, gate[keep])
    assert torch.equal(drafter.midlayer.mlp.down_proj.weight, down[:, keep])
    assert score[keep].min() >= score[[i for i in range(full) if i not in set(keep.tolist())]].max()


def test_channel_ranking_and_layer_ids():
    gate = torch.eye(4)
    up = torch.diag(torch.tensor([1.0, 4.0, 2.0, 3.0]))
    assert mlp_channels(gate, up, torch.eye(4), 2).tolist() == [1, 3]
    with pytest.raises(ValueError):
        mlp_channels(gate, up, torch.eye(4), 5)


def test_layer_ids_count_from_the_end(tiny_target):
    n = tiny_target.shape.num_layers
    assert resolve_layer(tiny_target, -1) == n - 1
    assert resolve_layer(tiny_target, 0) == 0
    with pytest.raises(ValueError):
        resolve_layer(tiny_target, n)
