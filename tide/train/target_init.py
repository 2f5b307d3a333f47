"""Initialise a drafter from the target's own weights: a strong prior for a data-starved drafter.

What is copied (``init_from_target``):
1. ``lm_head`` = the target's output rows of the draft vocab and ``norm`` = the target's final
   norm (``new_drafter`` already does both; repeated here so this step stands alone);
2. the mid layer from one target decoder layer (default: the last, whose output feeds the final
   norm and head copied in 1, so block, norm and head already fit together):
   - ``hidden_norm`` = that layer's ``input_layernorm`` (it normalises the same kind of stream);
   - q/k/v: the hidden half of their 2H inputs = the layer's q/k/v; the token-embedding half
     keeps the fresh init (the target layer has no such input; training learns it);
   - ``o_proj``, ``post_attention_layernorm`` and the MLP copied; a drafter MLP narrower than the
     target's keeps the channels with the largest gate*up*down weight norms (a slice of the
     layer, not the whole of it: ``mlp_channels``);
3. ``fc`` keeps its fresh init: it learns to map the aux states into that layer's input.
"""
from __future__ import annotations

import torch

from tide.drafter.model import Eagle3Drafter
from tide.models.llama import LlamaTarget


def resolve_layer(target: LlamaTarget, layer: int) -> int:
    """A layer id, negative ids counted from the end (-1 = the last layer)."""
    n = target.shape.num_layers
    index = layer + n if layer < 0 else layer
    if not 0 <= index < n:
        raise ValueError(f"target layer {layer} out of range for {n} layers")
    return index


def mlp_channels(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, keep: int) -> torch.Tensor:
    """Ids (ascending) of the ``keep`` MLP channels with the largest |gate_j|*|up_j|*|down_:,j|:
    a channel's output scales with all three, so the product ranks what dropping it loses."""
    if not 0 < keep <= gate.shape[0]:
        raise ValueError(f"keep must be in 1..{gate.shape[0]}, got {keep}")
    score = gate.float().norm(dim=1) * up.float().norm(dim=1) * down.float().norm(dim=0)
    return torch.sort(torch.topk(score, keep).indices).values


def layer_weights(target: LlamaTarget, layer: int) -> dict[str, torch.Tensor]:
    """The target layer's weights under the drafter mid layer's names (float32, MLP unsliced)."""
    p = f"layers.{resolve_layer(target, layer)}."
    w = target.w
    names = {
        "hidden_norm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "post_attention_layernorm.weight",
        "self_attn.q_proj.weight": "self_attn.q_proj.weight",
        "self_attn.k_proj.weight": "self_attn.k_proj.weight",
        "self_attn.v_proj.weight": "self_attn.v_proj.weight",
        "self_attn.o_proj.weight": "self_attn.o_proj.weight",
        "mlp.gate_proj.weight": "mlp.gate_proj.weight",
        "mlp.up_proj.weight": "mlp.up_proj.weight",
        "mlp.down_proj.weight": "mlp.down_proj.weight",
    }
    return {mine: w[p + theirs].float() for mine, theirs in names.items()}


@torch.no_grad()
def init_from_target(drafter: Eagle3Drafter, target: LlamaTarget, layer: int = -1) -> None:
    """Copy the target's head, final norm and decoder layer ``layer`` into ``drafter`` (in place)."""
    s, t = drafter.shape, target.shape
    if (s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) != (
            t.hidden_size, t.num_heads, t.num_kv_heads, t.head_dim):
        raise ValueError("target init needs the drafter's hidden size and attention shape to be the target's")
    drafter.lm_head.weight.copy_(target.lm_head_weight[drafter.draft_to_target].float())
    drafter.norm.weight.copy_(target.w["norm.weight"].float())
    src = layer_weights(target, layer)
    mid = drafter.midlayer
    hidden = s.hidden_size
    mid.hidden_norm.weight.copy_(src["hidden_norm.weight"])
    mid.post_attention_layernorm.weight.copy_(src["post_attention_layernorm.weight"])
    for name in "qkv":
        # the attention input is cat(embedding half, hidden half): the layer reads the hidden half
        getattr(mid.self_attn, f"{name}_proj").weight[:, hidden:].copy_(src[f"self_attn.{name}_proj.weight"])
    mid.self_attn.o_proj.weight.copy_(src["self_attn.o_proj.weight"])
    keep = mlp_channels(src["mlp.gate_proj.weight"], src["mlp.up_proj.weight"], src["mlp.down_proj.weight"],
                        s.intermediate_size)
    mid.mlp.gate_proj.weight.copy_(src["mlp.gate_proj.weight"][keep])
    mid.mlp.up_proj.weight.copy_(src["mlp.up_proj.weight"][keep])
    mid.mlp.down_proj.weight.copy_(src["mlp.down_proj.weight"][:, keep])
