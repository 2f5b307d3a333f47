"""Self-generated samples from several worker processes, and the samples file they hand back.

Greedy generation on a CPU runs at about one core's speed whatever torch's thread count (small
GEMMs and many small ops), so the static recipe splits its prompts into contiguous shards, each a
whole number of generation batches, and spawns one single-threaded process per shard. Every batch
then holds the same prompts, in the same order, as in one process: the samples are the same as a
one-process run's, in prompt order (``tests/unit/train/test_generation_pool.py``).

A worker loads the target from its checkpoint folder (``TargetSource``) rather than receiving it
pickled, and writes its samples to a safetensors file the parent reads back.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from tide.train.trainer import Sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetSource:
    """What a worker needs to load the same target: ``LlamaTarget.from_folder``'s arguments."""

    folder: str
    aux_layer_ids: tuple[int, ...]
    dtype: str = "float32"  # a torch dtype name
    max_seq_len: int = 2048


def save_samples(samples: list[Sample], path: Path) -> None:
    """Tokens, loss mask and states of each sample, and the target's argmax where the trainer
    computed it already (``target_top``: what the training ranks would otherwise each recompute)."""
    tensors = {}
    for i, s in enumerate(samples):
        aux, final = s.states()
        tensors.update({f"{i}.tokens": s.tokens, f"{i}.mask": s.loss_mask, f"{i}.aux": aux.contiguous(),
                        f"{i}.final": final.contiguous()})
        if s.target_top is not None:
            tensors[f"{i}.top"] = s.target_top
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two runs may build the same cache at once
    save_file(tensors, str(tmp))
    tmp.replace(path)


def load_samples(path: Path) -> list[Sample]:
    t = load_file(str(path))
    n = len({k.split(".")[0] for k in t})
    return [Sample(tokens=t[f"{i}.tokens"], loss_mask=t[f"{i}.mask"], aux=t[f"{i}.aux"], final=t[f"{i}.final"],
                   target_top=t.get(f"{i}.top")) for i in range(n)]


def shard_bounds(n: int, workers: int, batch: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` shards of ``n`` prompts for at most ``workers`` processes, each
    a whole number of ``batch``-sized groups (the last one ends at ``n``); none empty."""
    if n <= 0:
        return []
    groups = math.ceil(n / batch)
    per = math.ceil(groups / max(1, workers))
    return [(g * batch, min(n, (g + per) * batch)) for g in range(0, groups, per)]


def _generate_shard(source: TargetSource, prompts_ids: list[list[int]], max_new_tokens: int,
                    eos_ids: tuple[int, ...], batch_size: int, out_path: str) -> int:
    """One worker: load the target, generate its shard on one thread, write the samples."""
    from tide.models.llama import LlamaTarget
    from tide.train.offline import generate_samples

    torch.set_num_threads(1)  # one core per worker: two threads were no faster for this shape
    target = LlamaTarget.from_folder(source.folder, source.aux_layer_ids, getattr(torch, source.dtype),
                                     source.max_seq_len)
    samples = generate_samples(target, prompts_ids, max_new_tokens, eos_ids, batch_size=batch_size, progress=False)
    save_samples(samples, Path(out_path))
    return len(samples)


def generate_sharded(source: TargetSource, prompts_ids: Sequence[list[int]], max_new_tokens: int,
                     eos_ids: tuple[int, ...], batch_size: int, workers: int, scratch: Path) -> list[Sample]:
    """Greedy target answers to ``prompts_ids`` from up to ``workers`` processes, in prompt order."""
    bounds = shard_bounds(len(prompts_ids), workers, batch_size)
    scratch.mkdir(parents=True, exist_ok=True)
    paths = [scratch / f"shard-{os.getpid()}-{i}.safetensors" for i in range(len(bounds))]
    ctx = multiprocessing.get_context("spawn")  # no forked torch thread pools or open files
    try:
        with ProcessPoolExecutor(max_workers=max(1, len(bounds)), mp_context=ctx) as pool:
            futures = [pool.submit(_generate_shard, source, [list(p) for p in prompts_ids[a:b]], max_new_tokens,
                                   tuple(eos_ids), batch_size, str(path))
                       for (a, b), path in zip(bounds, paths)]
            for i, f in enumerate(futures):
                log.info("generation shard %d/%d: %d samples", i + 1, len(futures), f.result())
        return [s for path in paths for s in load_samples(path)]
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
