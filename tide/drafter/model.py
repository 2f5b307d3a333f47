"""The EAGLE3 draft model, parameter-compatible with SpecForge's ``LlamaForCausalLMEagle3``.

Parameter names (what SpecForge exports and SGLang loads): ``fc`` (3H→H), ``midlayer``
(``input_layernorm`` on token embeddings, ``hidden_norm`` on the hidden stream, attention whose
q/k/v read the 2H concatenation, ``post_attention_layernorm``, SwiGLU ``mlp``), ``norm``,
``lm_head`` (H→draft vocab), and the vocab-mapping buffers ``t2d`` (bool [vocab]) and ``d2t``
(int64 [draft vocab]; target id = draft id + d2t[draft id]). Token embeddings are the target's
(frozen, not exported), passed in by the caller.

One draft position (``step``):
1. ``h`` is either ``fc(aux)`` (target features) or the drafter's own previous output;
2. ``x = cat(input_layernorm(embed(token)), hidden_norm(h))`` → attention (RoPE at the absolute
   position) → ``h + attn`` → MLP residual: the new hidden ``h'``;
3. logits over the draft vocab = ``lm_head(norm(h'))``.

``for_serving`` returns an inference-only copy whose linears run the few-row C kernel
(``tide/models/rowkernel.py``) over bf16 weights: drafting streams the drafter's ~36 MB of float32
weights per token otherwise, a fifth of a speculative step on one core.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tide.drafter.confidence import Confidence
from tide.models.llama import KVCache, apply_rope, attend, rms_norm, rope_tables

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class DrafterShape:
    """What config.json records; ``aux_layer_ids`` uses TIDE's convention (inputs of those layers)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    aux_layer_ids: tuple[int, ...] = field(default=(2, 15, 27))
    # RMSNorm each aux chunk before fc (SpecForge's ``fc_norm``): the target's residual streams
    # carry massive activations (|x| ~ 2.5e4 at sink positions in SmolLM2) that otherwise swamp fc
    fc_norm: bool = False

    def to_hf_config(self, extra: dict | None = None) -> dict:
        """The config.json SpecForge and SGLang read."""
        cfg = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "pretraining_tp": 1,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            # SGLang adds 1 to explicit ids (it captures the output of layer id = input of id+1).
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layer_ids]},
            "tide_aux_layer_ids": list(self.aux_layer_ids),
        }
        if self.fc_norm:
            cfg["fc_norm"] = True
        cfg.update(extra or {})
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "DrafterShape":
        if cfg.get("architectures") != [ARCHITECTURE]:
            raise ValueError(f"drafter architectures must be [{ARCHITECTURE!r}], got {cfg.get('architectures')!r}")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"drafter must have num_hidden_layers=1, got {cfg.get('num_hidden_layers')}")
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        # head_dim defaults to hidden / heads; a bad heads value is left for the bounds check
        default_head_dim = hidden // heads if isinstance(heads, int) and isinstance(hidden, int) and heads > 0 else 0
        if "tide_aux_layer_ids" in cfg:
            aux = tuple(cfg["tide_aux_layer_ids"])
        else:
            aux = tuple(i + 1 for i in cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids", []))
        return cls(
            hidden_size=hidden, intermediate_size=cfg["intermediate_size"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or default_head_dim,
            vocab_size=cfg["vocab_size"], draft_vocab_size=cfg.get("draft_vocab_size", cfg["vocab_size"]),
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048), aux_layer_ids=aux,
            fc_norm=cfg.get("fc_norm", False),
        )

    def as_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(2 * s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, q, _ = x.shape
        s = self.s
        qs = self.q_proj(x).view(b, q, s.num_heads, s.head_dim)
        ks = self.k_proj(x).view(b, q, s.num_kv_heads, s.head_dim)
        vs = self.v_proj(x).view(b, q, s.num_kv_heads, s.head_dim)
        return apply_rope(qs, cos, sin), apply_rope(ks, cos, sin), vs


class MLP(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.mlp = MLP(s)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = hidden + self.self_attn.o_proj(attn_out)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, shape: DrafterShape):
        super().__init__()
        self.shape = shape
        s = shape
        self.fc = nn.Linear(3 * s.target_hidden_size, s.hidden_size, bias=False)
        self.fc_norm = nn.ModuleList([RMSNorm(s.target_hidden_size, s.rms_norm_eps) for _ in range(3)]) \
            if s.fc_norm else None
        self.midlayer = MidLayer(s)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)
        self.register_buffer("t2d", torch.ones(s.vocab_size, dtype=torch.bool))
        self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.int64))
        cos, sin = rope_tables(s.head_dim, s.rope_theta, s.max_position_embeddings + 64)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # the calibrated confidence head, when the artifact has one: plain tensors, not a
        # submodule, so the state_dict stays exactly SpecForge's and SGLang's
        self.confidence: Confidence | None = None

    def set_vocab_mapping(self, d2t: torch.Tensor) -> None:
        """d2t: [draft_vocab] offsets; t2d is derived (True where a target id has a draft id)."""
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"d2t shape {tuple(d2t.shape)} != {tuple(self.d2t.shape)}")
        self.d2t.copy_(d2t)
        t2d = torch.zeros_like(self.t2d)
        t2d[torch.arange(len(d2t)) + d2t] = True
        self.t2d.copy_(t2d)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [.., 3H] → the drafter's hidden stream [.., H]."""
        aux = aux.to(self.norm.weight.dtype)
        if self.fc_norm is not None:
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return self.fc(aux)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] target token id of each draft id."""
        return torch.arange(self.shape.draft_vocab_size, device=self.d2t.device) + self.d2t

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_cos[positions], self.rope_sin[positions]

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        s = self.shape
        return KVCache(1, num_slots, max_len, s.num_kv_heads, s.head_dim, self.norm.weight.dtype)

    @torch.inference_mode()
    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: KVCache, slots: torch.Tensor,
             positions: torch.Tensor, first_key: torch.Tensor | None = None) -> torch.Tensor:
        """One cached forward (inference). embeds/hidden: [B, q, H]; positions: [B, q] absolute.

        Returns the new hidden stream [B, q, H] (pre-norm); feed it back as ``hidden`` for the next
        draft position, or take ``logits`` of it.
        """
        layer = self.midlayer
        x = layer.attn_input(embeds, hidden)
        cos, sin = self.rope_at(positions)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        out = attend(q, k, v, cache, 0, slots, positions, first_key)
        return layer.finish(hidden, out)

    def causal_forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Uncached full-sequence forward (positions 0..T-1, causal); used by tests and eval."""
        b, t, _ = embeds.shape
        layer = self.midlayer
        x = layer.attn_input(embeds, hidden)
        cos, sin = self.rope_at(torch.arange(t).expand(b, t))
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
        return layer.finish(hidden, out.transpose(1, 2).reshape(b, t, -1))

    def init_weights(self, seed: int = 0) -> None:
        """Small random init (std 0.02), norms at 1; used for fresh drafters and tests."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)


class RowLinear(nn.Module):
    """Serving-only stand-in for a bias-free ``nn.Linear``: the row kernel for few rows on one
    thread, over bf16 weights when that is exact (artifacts are stored in bf16, so a loaded
    drafter's weights are) and float32 otherwise; torch's linear on the float32 copy for larger
    batches or multi-threaded engines."""

    MAX_ROWS = 16  # as the target's Linears: beyond this oneDNN/MKL GEMMs catch up

    def __init__(self, weight: torch.Tensor, kernel):
        super().__init__()
        w32 = weight.detach().float().contiguous()
        w16 = w32.bfloat16()
        # ``weight`` keeps nn.Linear's state_dict key and value: a served drafter exports and
        # compares like the drafter it came from; the kernel's copy is not part of the state
        self.register_buffer("weight", w32)
        self.register_buffer("wk", w16 if torch.equal(w16.float(), w32) else w32, persistent=False)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= self.MAX_ROWS and x.dtype == torch.float32 and torch.get_num_threads() == 1:
            out = self.kernel(flat, self.wk)
        else:
            out = F.linear(flat, self.weight.to(x.dtype))
        return out.view(*x.shape[:-1], out.shape[-1])


def for_serving(drafter: Eagle3Drafter) -> Eagle3Drafter:
    """An eval-mode copy with every linear replaced by ``RowLinear`` (the drafter itself is left
    as it was); the drafter unchanged where the row kernel does not run on this machine."""
    from tide.models.rowkernel import load

    if not isinstance(drafter, Eagle3Drafter):  # a stand-in (tests) is served as given
        return drafter
    kernel = load()
    if kernel is None or any(isinstance(m, RowLinear) for m in drafter.modules()):
        return drafter
    served = copy.deepcopy(drafter).eval()
    for module in list(served.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None:
                setattr(module, name, RowLinear(child.weight, kernel))
    served.requires_grad_(False)
    return served
