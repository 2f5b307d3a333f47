"""The draft confidence head: a calibrated probability that draft k survives greedy verification.

DSpark's head: ``c_k = σ(w·[h_k, e(x_k)] + b)``, where ``h_k`` is the drafter's (normed) hidden
state that produced draft k and ``e(x_k)`` the (normed) embedding of the token fed at that step.
TIDE adds one scalar input, the draft's own log top probability (what the old stop rule used),
so the head starts from that signal and only learns what it misses. One temperature per depth
(fitted by ``tide/train/confidence.py``) makes ``survival`` P(draft k survives | drafts < k did),
so the product over depths is a chain's survival.

Stored beside the drafter, not in ``model.safetensors`` (SGLang loads every tensor there), as
``confidence/head.safetensors`` whose sha256 ``tide.json`` records; the calibration report goes
into ``tide.json`` too. A drafter folder without it has no head, and serving keeps the plain
stop rule.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tide.models.llama import rms_norm

HEAD_DIR = "confidence"
HEAD_WEIGHTS = "head.safetensors"
CONFIDENCE_SHA = "confidence_sha256"  # the tide.json key of the head's checksum
MAX_DEPTH = 64
MAX_HEAD_BYTES = 1 << 20  # a head is 2H+1 floats: far below this for any drafter TIDE bounds


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, depth: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.proj = nn.Linear(2 * hidden_size + 1, 1)
        self.register_buffer("temperature", torch.ones(depth))

    def logit(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).squeeze(-1)

    def survival(self, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """[n] calibrated P(draft survives | previous drafts survived)."""
        t = self.temperature[depth.clamp(max=len(self.temperature) - 1)]
        return torch.sigmoid(self.logit(x) / t)


def features(hidden: torch.Tensor, embeds: torch.Tensor, logits: torch.Tensor, eps: float) -> torch.Tensor:
    """[n, 2H+1] head input from the drafter's step output and the fed token's embedding."""
    ones = torch.ones(hidden.shape[-1], dtype=torch.float32)
    log_top = torch.log_softmax(logits.float(), dim=-1).max(-1).values
    return torch.cat((rms_norm(hidden.float(), ones, eps), rms_norm(embeds.float(), ones, eps),
                      log_top[:, None]), dim=-1)


@dataclass(frozen=True)
class Confidence:
    """A fitted head as serving holds it: plain tensors on the drafter, outside its state_dict."""

    weight: torch.Tensor  # [2H+1]
    bias: float
    temperature: torch.Tensor  # [depth]

    @torch.inference_mode()
    def survival(self, hidden: torch.Tensor, embeds: torch.Tensor, logits: torch.Tensor, depth: int,
                 eps: float) -> torch.Tensor:
        """[n] P(this draft survives | the row's previous drafts did), at draft depth ``depth``."""
        z = features(hidden, embeds, logits, eps) @ self.weight + self.bias
        return torch.sigmoid(z / self.temperature[min(depth, len(self.temperature) - 1)])


def frozen(head: ConfidenceHead) -> Confidence:
    return Confidence(head.proj.weight.detach().flatten().float().clone(), float(head.proj.bias),
                      head.temperature.detach().float().clone())


def save_confidence(conf: Confidence, folder: Path) -> str:
    """Write ``confidence/`` into a drafter folder being built; returns the weights' sha256."""
    out = folder / HEAD_DIR
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"weight": conf.weight.contiguous(), "bias": torch.tensor([conf.bias]),
               "temperature": conf.temperature.contiguous()}
    save_file(tensors, str(out / HEAD_WEIGHTS))
    return hashlib.sha256((out / HEAD_WEIGHTS).read_bytes()).hexdigest()


def load_confidence(folder: Path, hidden_size: int, expect_sha256: str | None) -> Confidence | None:
    """The folder's head, or None when it has none. Raises ValueError on a head that does not fit
    the drafter, is not finite, has a non-positive temperature, or fails its recorded checksum."""
    path = folder / HEAD_DIR / HEAD_WEIGHTS
    if not path.is_file():
        if expect_sha256:
            raise ValueError(f"{path}: recorded in tide.json but missing")
        return None
    if path.stat().st_size > MAX_HEAD_BYTES:
        raise ValueError(f"{path}: larger than {MAX_HEAD_BYTES} bytes")
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if expect_sha256 != actual:
        raise ValueError(f"{path}: checksum mismatch (recorded {expect_sha256}, actual {actual})")
    t = load_file(str(path))
    weight, bias, temp = t.get("weight"), t.get("bias"), t.get("temperature")
    if weight is None or bias is None or temp is None or set(t) != {"weight", "bias", "temperature"}:
        raise ValueError(f"{path}: expected tensors weight, bias, temperature; got {sorted(t)}")
    if tuple(weight.shape) != (2 * hidden_size + 1,) or bias.numel() != 1 or temp.dim() != 1 \
            or not 1 <= temp.numel() <= MAX_DEPTH:
        raise ValueError(f"{path}: shapes weight {tuple(weight.shape)}, bias {tuple(bias.shape)}, "
                         f"temperature {tuple(temp.shape)} do not fit hidden size {hidden_size}")
    if not all(bool(torch.isfinite(x).all()) for x in (weight, bias, temp)) or bool((temp <= 0).any()):
        raise ValueError(f"{path}: non-finite values or a non-positive temperature")
    return Confidence(weight.float(), float(bias), temp.float())
