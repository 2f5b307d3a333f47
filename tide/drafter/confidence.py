"""The draft confidence head: a calibrated probability that draft k survives greedy verification.

DSpark's head: ``c_k = σ(w·[h_k, e(x_k)] + b)``, where ``h_k`` is the drafter's (normed) hidden
state that produced draft k and ``e(x_k)`` the (normed) embedding of the token fed at that step.
TIDE adds one scalar input, the draft's own log top probability (what the old stop rule used),
so the head starts from that signal and only learns what it misses. One temperature per depth
(fitted by ``tide/train/confidence.py``) makes ``survival`` P(draft k survives | drafts < k did),
so the product over depths is a chain's survival.

Stored beside the drafter, not in ``model.safetensors`` (SGLang loads every tensor there), as
``confidence/head.safetensors`` whose sha256 ``tide.json`` records; the head's held-out ECE rides
in that file's safetensors header (``heldout_ece``), so it travels with the head whoever writes
``tide.json``. Serving uses a head only where that ECE is recorded and at most ``MAX_HEAD_ECE``
(``serving_head``); otherwise, or without a head, the schedulers read the drafter's top-probability
chain (scaled on live traffic) instead.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from tide.models.llama import rms_norm

HEAD_DIR = "confidence"
HEAD_WEIGHTS = "head.safetensors"
CONFIDENCE_SHA = "confidence_sha256"  # the tide.json key of the head's checksum
MAX_DEPTH = 64
MAX_HEAD_BYTES = 1 << 20  # a head is 2H+1 floats: far below this for any drafter TIDE bounds
# a head calibrated worse than this on held-out data is not served: its survivals would mislead
# the admission more than the top-probability chain, which live traffic scales
MAX_HEAD_ECE = 0.05
ECE_KEY = "heldout_ece"  # the head file's header entry


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, depth: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.proj = nn.Linear(2 * hidden_size + 1, 1)
        self.register_buffer("temperature", torch.ones(depth))
        self.heldout_ece: float | None = None  # set by the fit that measured it (tide/train/confidence.py)

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
    heldout_ece: float | None = None  # the ECE its fit measured on held-out answers; None: never measured

    @torch.inference_mode()
    def survival(self, hidden: torch.Tensor, embeds: torch.Tensor, logits: torch.Tensor, depth: int,
                 eps: float) -> torch.Tensor:
        """[n] P(this draft survives | the row's previous drafts did), at draft depth ``depth``."""
        z = features(hidden, embeds, logits, eps) @ self.weight + self.bias
        return torch.sigmoid(z / self.temperature[min(depth, len(self.temperature) - 1)])


def frozen(head: ConfidenceHead) -> Confidence:
    return Confidence(head.proj.weight.detach().flatten().float().clone(), float(head.proj.bias.detach()),
                      head.temperature.detach().float().clone(), head.heldout_ece)


def serving_head(conf: Confidence | None) -> tuple[Confidence | None, str]:
    """(the head to serve with, why): a head only where its held-out ECE is recorded and at most
    ``MAX_HEAD_ECE``; else None (the top-probability chain serves) and the reason."""
    if conf is None:
        return None, "no confidence head"
    if conf.heldout_ece is None:
        return None, "confidence head has no held-out ECE recorded"
    if not conf.heldout_ece <= MAX_HEAD_ECE:
        return None, f"confidence head's held-out ECE {conf.heldout_ece:.4f} > {MAX_HEAD_ECE}"
    return conf, f"confidence head, held-out ECE {conf.heldout_ece:.4f}"


def save_confidence(conf: Confidence, folder: Path) -> str:
    """Write ``confidence/`` into a drafter folder being built; returns the weights' sha256."""
    out = folder / HEAD_DIR
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"weight": conf.weight.contiguous(), "bias": torch.tensor([conf.bias]),
               "temperature": conf.temperature.contiguous()}
    header = {ECE_KEY: repr(float(conf.heldout_ece))} if conf.heldout_ece is not None else None
    save_file(tensors, str(out / HEAD_WEIGHTS), metadata=header)
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
    return Confidence(weight.float(), float(bias), temp.float(), _heldout_ece(path))


def _heldout_ece(path: Path) -> float | None:
    """The head file's recorded held-out ECE (None when absent; an unreadable one is refused)."""
    with safe_open(str(path), "pt") as f:
        value = (f.metadata() or {}).get(ECE_KEY)
    if value is None:
        return None
    try:
        ece = float(value)
    except ValueError as exc:
        raise ValueError(f"{path}: {ECE_KEY} {value!r} is not a number") from exc
    if not 0.0 <= ece <= 1.0:
        raise ValueError(f"{path}: {ECE_KEY} {ece} is outside [0, 1]")
    return ece
