"""Draft vocabulary: the most frequent target tokens, as SpecForge's t2d/d2t buffers.

Steps: count target token ids in training data → keep the ``draft_vocab_size`` most frequent
(ties broken by lower id; ids that never occur fill up from the lowest ids) → sort kept ids
ascending → ``d2t[i] = kept[i] - i`` so that target id = draft id + d2t[draft id].
The mapping stays fixed across retrains: SGLang builds its hot-token table from d2t once at start.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        ids = torch.as_tensor(list(seq), dtype=torch.int64)
        if ids.numel():
            if int(ids.max()) >= vocab_size or int(ids.min()) < 0:
                raise ValueError(f"token id out of range [0, {vocab_size})")
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_d2t(counts: torch.Tensor, draft_vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """Offsets for the ``draft_vocab_size`` most frequent ids (``always`` ids forced in, e.g. EOS)."""
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab_size}, got {draft_vocab_size}")
    score = counts.double().clone()
    forced = list(always)
    score[forced] = float("inf")
    # stable descending sort: equal counts keep ascending id order
    order = torch.sort(-score, stable=True).indices
    kept = torch.sort(order[:draft_vocab_size]).values
    return kept - torch.arange(draft_vocab_size)


def mapping_digest(d2t: torch.Tensor) -> str:
    """A short fingerprint of the mapping, to check that retrains keep it fixed."""
    return hashlib.sha256(d2t.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]
