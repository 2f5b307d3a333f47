"""A small Llama forward with a slot-based KV cache, for the reference engine.

Why not call transformers' forward: the engine batches requests whose sequences have different
lengths and rolls back rejected draft positions per request. A cache laid out as
``[slots, max_len, kv_heads, head_dim]`` with an explicit per-row start position makes both
trivial (rollback = forget positions past the committed length). Weights come from the same
HF-layout safetensors checkpoint transformers loads; tests check logits against transformers.

Forward steps for a batch of rows (row b: ``q`` new tokens at positions ``start[b] + i``):
1. embed the tokens, and for each decoder layer: RMSNorm → q/k/v projections → RoPE at the
   rows' absolute positions → write k/v into the rows' cache slots → attend over cached
   positions ``j <= start[b] + i`` (causal; padding past a row's real tokens is never attended by
   its real queries) → o_proj + residual → RMSNorm → SwiGLU MLP + residual;
2. record the inputs of the EAGLE3 aux layers (SGLang convention) and the final normed state;
3. project to logits (all positions, or only the last per row for prefill).

A packed verify (``lengths``): rows of different draft lengths in one forward, each row's tokens
past its length never computed. Every linear (the projections, the MLP, the LM head: nearly all
of a CPU forward's time) runs on the rows' real tokens only, laid flat; attention alone works on
the padded [B, q] layout (queries scattered back per row), so a depth-3 draft on one request
does not cost depth 3 on every row.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaShape":
        if cfg.get("model_type", "llama") != "llama":
            raise ValueError(f"target model_type {cfg.get('model_type')!r} is not supported (llama only)")
        rope = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        if rope_type not in ("default", None):
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported by the reference engine")
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """SGLang's EAGLE3 default: the inputs of layers 2, n//2 and n-3."""
    return (2, num_layers // 2, num_layers - 3)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_tables(head_dim: int, theta: float, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, q, heads, hd]; cos/sin: [B, q, hd] gathered at the rows' positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class KVCache:
    """Keys/values for ``num_slots`` sequences: ``[layers, slots, max_len, kv_heads, head_dim]``.

    The cache does not track lengths: the caller passes each row's start position, and positions
    past a sequence's committed length are simply overwritten by its next forward.
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32):
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.max_len = max_len
        self.num_slots = num_slots

    def move(self, slot: int, src: int, dst: int) -> None:
        """Copy position ``src``'s keys/values to ``dst`` in every layer (an accepted tree branch
        moves to where the sequence continues)."""
        self.k[:, slot, dst] = self.k[:, slot, src]
        self.v[:, slot, dst] = self.v[:, slot, src]


def attend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: KVCache, layer: int,
           slots: torch.Tensor, positions: torch.Tensor, first_key: torch.Tensor | None = None,
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Write k/v at ``positions`` of ``slots`` and attend causally over each row's cache.

    q: [B, q, heads, hd]; k_new/v_new: [B, q, kv_heads, hd]; positions: [B, q] absolute (consecutive
    per row); ``first_key`` ([B], optional): keys before it are not attended (a drafter swapped in
    mid-request has no keys for the positions before its first feed); ``mask`` ([B, q, kv_len]
    bool, optional, ``tree_mask``): which keys each query attends to, instead of causal.
    """
    bsz, qlen, heads, hd = q.shape
    cache.k[layer][slots[:, None], positions] = k_new
    cache.v[layer][slots[:, None], positions] = v_new
    kv_len = int(positions.max()) + 1
    slot_list = slots.tolist()
    if slot_list == list(range(slot_list[0], slot_list[0] + bsz)):
        keys = cache.k[layer, slot_list[0]:slot_list[0] + bsz, :kv_len]  # view, no copy
        values = cache.v[layer, slot_list[0]:slot_list[0] + bsz, :kv_len]
    else:
        keys = cache.k[layer][slots, :kv_len]
        values = cache.v[layer][slots, :kv_len]
    key_pos = torch.arange(kv_len)[None, None, :]
    if mask is None:
        mask = key_pos <= positions[:, :, None]  # [B, q, kv_len]
    if first_key is not None:
        mask = mask & (key_pos >= first_key[:, None, None])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask[:, None], enable_gqa=heads != keys.shape[2])
    return out.transpose(1, 2).reshape(bsz, qlen, heads * hd)


def tree_mask(positions: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """[B, q, kv_len] bool for ``attend``: every cached key before a row's new tokens, then, among
    the new tokens (at consecutive ``positions`` [B, q]), those ``ancestors`` [q, q] marks. Built
    once per forward: every layer attends alike."""
    bsz, qlen = positions.shape
    key_pos = torch.arange(int(positions.max()) + 1)[None, None, :]
    rel = key_pos - positions[:, :1, None]  # [B, 1, kv_len]: the key's index among the new tokens
    block = ancestors[None].expand(bsz, qlen, qlen).gather(2, rel.clamp(0, qlen - 1).expand(bsz, qlen, -1))
    return (rel < 0) | ((rel < qlen) & block)


class Linears:
    """``y = x @ W.T`` for the target's projection weights, by one kernel for every row count:
    the few-row C kernel (``rows``) or oneDNN with prepacked weights (``onednn``), as ``kernel``
    says; ``auto`` checks and times both at start-up (``kernels.py``) and keeps the faster of
    those that compute a row bitwise alike at every row count, so a decode and a verify compute a
    token alike (greedy output equal to the target alone's).

    Why: decode (1 token) and verify (γ+1 tokens) on CPU are bound by streaming the weights from
    memory, and what speculative decoding pays per step is the verify/decode cost ratio. MKL's
    small-M sgemm reads the weights at under half its gemv speed for M=2..8; the row kernel
    (``rowkernel.py``: one pass over the weights for up to 6 rows) keeps a 6-token forward close to
    a decode; oneDNN with weights reordered once runs 3..16 rows faster still where its blocked
    kernel suits the CPU (AVX-512), but it takes other kernels for 1 and 2 rows (slower than 3,
    and for some shapes rounded differently), so fewer rows are padded to ``ONEDNN_MIN_ROWS``
    (``bench/forward.py``; docs/benchmarks.md). The row kernel is single-threaded: it serves up to
    ``ROW_KERNEL_MAX_ROWS`` rows when torch runs on one thread, oneDNN the rest.
    """

    # the reorder's batch-size hint: tuned for verify-sized M (1..40 rows measured alike)
    PACK_HINT_ROWS = 16
    # above this many rows oneDNN's blocked GEMM catches up with the row kernel
    ROW_KERNEL_MAX_ROWS = 16
    # oneDNN rows below this are padded with zeros: one kernel for every row count
    ONEDNN_MIN_ROWS = 3
    # the onednn candidate is checked batch-invariant up to this many rows (8 requests x 5 tokens)
    ONEDNN_CHECK_ROWS = 40

    def __init__(self, w: dict[str, torch.Tensor], names: list[str], packed: bool, kernel: str = "auto"):
        if kernel not in ("auto", "rows", "onednn"):
            raise ValueError(f"linear kernel {kernel!r}: auto, rows or onednn")
        self.w = w
        self.packed: dict[str, torch.Tensor] = {}
        self.rows = None
        if kernel != "onednn" and all(w[name].dtype == torch.float32 and w[name].is_contiguous() for name in names):
            from tide.models.rowkernel import load
            self.rows = load()
        if packed and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            try:
                for name in names:
                    self.packed[name] = torch.ops.mkldnn._reorder_linear_weight(w[name], self.PACK_HINT_ROWS)
            except (RuntimeError, AttributeError):  # a torch build without the reorder op
                self.packed = {}
        self.choice = None
        if kernel == "auto" and self.rows is not None and self.packed and torch.get_num_threads() == 1:
            from tide.models.kernels import choose
            self.choice = choose({"rows": self._rows_product, "onednn": self._onednn_product}, w, names,
                                 {"rows": self.ROW_KERNEL_MAX_ROWS, "onednn": self.ONEDNN_CHECK_ROWS})
            if self.choice.kernel == "onednn":
                self.rows = None

    @property
    def kernel(self) -> str:
        """What computes a few-row product: rows | onednn | torch (neither available)."""
        if self.rows is not None and torch.get_num_threads() == 1:
            return "rows"
        return "onednn" if self.packed else "torch"

    def __call__(self, x: torch.Tensor, name: str) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.rows is not None and flat.shape[0] <= self.ROW_KERNEL_MAX_ROWS and torch.get_num_threads() == 1:
            out = self._rows_product(flat, name)
        elif name in self.packed:
            out = self._onednn_product(flat, name)
        else:
            return F.linear(x, self.w[name])
        return out.view(*x.shape[:-1], out.shape[-1])

    def _rows_product(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        return self.rows(flat if flat.is_contiguous() else flat.contiguous(), self.w[name])

    def _onednn_product(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        m = flat.shape[0]
        if m < self.ONEDNN_MIN_ROWS:
            flat = torch.cat([flat, flat.new_zeros(self.ONEDNN_MIN_ROWS - m, flat.shape[1])])
        elif not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed[name], None, "none", [], "")
        return out[:m] if m < self.ONEDNN_MIN_ROWS else out


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, q or 1, V]
    aux_hidden: torch.Tensor | None  # [B, q, 3H]
    final_hidden: torch.Tensor  # [B, q, H], after the final norm


class LlamaTarget:
    """Inference-only Llama (no autograd) over a checkpoint folder (config.json + model.safetensors)."""

    def __init__(self, shape: LlamaShape, weights: dict[str, torch.Tensor],
                 aux_layer_ids: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
                 max_seq_len: int = 2048, packed: bool = True, kernel: str = "auto"):
        self.shape = shape
        self.dtype = dtype
        self.aux_layer_ids = tuple(aux_layer_ids) or default_aux_layer_ids(shape.num_layers)
        if len(self.aux_layer_ids) != 3 or not all(0 < i < shape.num_layers for i in self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids must be 3 layer ids in 1..{shape.num_layers - 1}, "
                             f"got {self.aux_layer_ids}")
        w = {k.removeprefix("model."): v.to(dtype) for k, v in weights.items()}
        if "lm_head.weight" not in w:
            if not shape.tie_word_embeddings:
                raise ValueError("checkpoint has no lm_head.weight and does not tie embeddings")
            w["lm_head.weight"] = w["embed_tokens.weight"]
        # fused projections: fewer, wider matmuls are markedly faster for the few-token
        # batches of decode/verify on CPU (small-M GEMM is dominated by per-call overhead)
        for i in range(shape.num_layers):
            p = f"layers.{i}."
            w[p + "qkv"] = torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            w[p + "gate_up"] = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        self.w = w
        self.linear = Linears(w, [k for k in w if k.endswith(("qkv", "gate_up", "o_proj.weight", "down_proj.weight"))]
                              + ["lm_head.weight"], packed=packed and dtype == torch.float32, kernel=kernel)
        self.max_seq_len = max_seq_len
        self.cos, self.sin = rope_tables(shape.head_dim, shape.rope_theta, max_seq_len + 64)

    @classmethod
    def from_folder(cls, folder: str | Path, aux_layer_ids: tuple[int, ...] = (),
                    dtype: torch.dtype = torch.float32, max_seq_len: int = 2048,
                    packed: bool = True, kernel: str = "auto") -> "LlamaTarget":
        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        weights = load_file(str(folder / "model.safetensors"))
        return cls(LlamaShape.from_hf_config(cfg), weights, aux_layer_ids, dtype, max_seq_len, packed, kernel)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.w["embed_tokens.weight"]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.w["lm_head.weight"]

    def new_cache(self, num_slots: int, max_len: int | None = None) -> KVCache:
        s = self.shape
        return KVCache(s.num_layers, num_slots, max_len or self.max_seq_len + 16, s.num_kv_heads,
                       s.head_dim, self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, cache: KVCache,
                slots: torch.Tensor, last_only: bool = False, want_aux: bool = True,
                tree: tuple[torch.Tensor, torch.Tensor] | None = None,
                lengths: torch.Tensor | None = None) -> TargetOutput:
        """input_ids: [B, q]; start: [B] first absolute position of each row's new tokens, which
        fill cache positions ``start..start+q-1``. ``tree`` (a draft tree, the same layout in every
        row): (depth [q], ancestor mask [q, q] bool): token i sits at sequence position
        ``start + depth[i]`` (its RoPE) and attends to the new tokens ``mask[i]`` marks.
        ``lengths`` ([B], 1..q, a packed verify): row b's tokens are its first ``lengths[b]``; the
        outputs past them are zeros."""
        if lengths is not None:
            if tree is not None or last_only:
                raise ValueError("a packed forward takes neither a tree nor last_only")
            return self._forward_packed(input_ids, start, cache, slots, lengths, want_aux)
        s, w = self.shape, self.w
        bsz, qlen = input_ids.shape
        positions = start[:, None] + torch.arange(qlen)[None, :]
        if int(positions.max()) >= cache.max_len:
            raise ValueError(f"sequence position {int(positions.max())} exceeds cache length {cache.max_len}")
        seq_pos = positions if tree is None else start[:, None] + tree[0][None, :]
        mask = None if tree is None else tree_mask(positions, tree[1])
        cos, sin = self.cos[seq_pos], self.sin[seq_pos]
        kv_dim = s.num_kv_heads * s.head_dim
        lin = self.linear
        h = F.embedding(input_ids, w["embed_tokens.weight"])
        aux: dict[int, torch.Tensor] = {}
        for i in range(s.num_layers):
            if want_aux and i in self.aux_layer_ids:
                aux[i] = h
            p = f"layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], s.rms_norm_eps)
            q, k, v = lin(x, p + "qkv").split([s.num_heads * s.head_dim, kv_dim, kv_dim], dim=-1)
            q = q.view(bsz, qlen, s.num_heads, s.head_dim)
            k = k.view(bsz, qlen, s.num_kv_heads, s.head_dim)
            v = v.reshape(bsz, qlen, s.num_kv_heads, s.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            attn = attend(q, k, v, cache, i, slots, positions, mask=mask)
            h = h + lin(attn, p + "self_attn.o_proj.weight")
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
            gate, up = lin(x, p + "gate_up").chunk(2, dim=-1)
            h = h + lin(F.silu(gate) * up, p + "mlp.down_proj.weight")
        final = rms_norm(h, w["norm.weight"], s.rms_norm_eps)
        head_in = final[:, -1:] if last_only else final
        logits = lin(head_in, "lm_head.weight")
        aux_cat = torch.cat([aux[i] for i in self.aux_layer_ids], dim=-1) if want_aux else None
        return TargetOutput(logits=logits, aux_hidden=aux_cat, final_hidden=final)

    def _forward_packed(self, input_ids: torch.Tensor, start: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                        lengths: torch.Tensor, want_aux: bool) -> TargetOutput:
        """``forward`` over each row's first ``lengths[b]`` tokens: linears on those M tokens laid flat
        ([1, M]), attention per row on the padded layout (its padded queries are never read; the keys
        they write sit past the row's real tokens, where causal masking keeps real queries away and
        the row's next forward overwrites them)."""
        s, w = self.shape, self.w
        bsz, qlen = input_ids.shape
        if int(lengths.min()) < 1 or int(lengths.max()) > qlen:
            raise ValueError(f"packed lengths must be in 1..{qlen}, got {lengths.tolist()}")
        positions = start[:, None] + torch.arange(qlen)[None, :]
        if int(positions.max()) >= cache.max_len:
            raise ValueError(f"sequence position {int(positions.max())} exceeds cache length {cache.max_len}")
        flat = (torch.arange(qlen)[None, :] < lengths[:, None]).flatten().nonzero().flatten()  # [M] in B*q
        cos, sin = self.cos[positions], self.sin[positions]
        q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        lin = self.linear

        def unpack(x: torch.Tensor) -> torch.Tensor:  # [1, M, D] -> [B, q, D], zeros past each row's length
            return x.new_zeros(bsz * qlen, x.shape[-1]).index_copy_(0, flat, x[0]).view(bsz, qlen, -1)

        h = F.embedding(input_ids.flatten().index_select(0, flat), w["embed_tokens.weight"])[None]  # [1, M, H]
        aux: dict[int, torch.Tensor] = {}
        for i in range(s.num_layers):
            if want_aux and i in self.aux_layer_ids:
                aux[i] = h
            p = f"layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], s.rms_norm_eps)
            q, k, v = unpack(lin(x, p + "qkv")).split([q_dim, kv_dim, kv_dim], dim=-1)
            q = apply_rope(q.reshape(bsz, qlen, s.num_heads, s.head_dim), cos, sin)
            k = apply_rope(k.reshape(bsz, qlen, s.num_kv_heads, s.head_dim), cos, sin)
            attn = attend(q, k, v.reshape(bsz, qlen, s.num_kv_heads, s.head_dim), cache, i, slots, positions)
            h = h + lin(attn.reshape(bsz * qlen, -1).index_select(0, flat)[None], p + "self_attn.o_proj.weight")
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
            gate, up = lin(x, p + "gate_up").chunk(2, dim=-1)
            h = h + lin(F.silu(gate) * up, p + "mlp.down_proj.weight")
        final = rms_norm(h, w["norm.weight"], s.rms_norm_eps)
        logits = lin(final, "lm_head.weight")
        aux_cat = unpack(torch.cat([aux[i] for i in self.aux_layer_ids], dim=-1)) if want_aux else None
        return TargetOutput(logits=unpack(logits), aux_hidden=aux_cat, final_hidden=unpack(final))
