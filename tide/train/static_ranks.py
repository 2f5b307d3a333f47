"""The static recipe's training on several CPU processes: data parallel over gloo, one core each.

Why: one training step on a CPU runs at about one core's speed whatever torch's thread count
(small ops, not GEMMs, bound it), so on a machine with N cores the recipe's training half uses one
of them unless it runs N processes. ``train_ranked`` makes this process rank 0 and spawns the
others; every rank trains the same drafter on its share of each step's batches
(``tide/train/distributed.py``), so a step's update equals one process accumulating those batches.

Steps of ``train_ranked``:
1. compute the target's argmax once here (``prepare``) and write the samples with it, the
   drafter and the target's embedding and lm_head to a fresh scratch folder (safetensors);
2. spawn ``world - 1`` processes; each loads those files, joins the gloo group at a loopback port
   and trains its share; this process trains rank 0's share with the drafter it holds;
3. tear down the group, wait for the ranks, delete the scratch files.
If rank 0 fails, the spawned ranks are terminated; a spawned rank that fails ends rank 0 at its next
collective (gloo's timeout at the latest). The process must hold no torch.distributed group of its own
(refused): the recipe runs as its own command. Unlike an online retrain under ``torchrun``
(``tide/train/ranks.py``), the recipe is one command on one machine, so it starts its own ranks.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing
import shutil
import tempfile
import traceback
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tide.drafter.artifact import load_drafter, save_drafter
from tide.drafter.model import Eagle3Drafter
from tide.process import free_port
from tide.train.distributed import Ranks, exit_rank
from tide.train.generation_pool import load_samples, save_samples
from tide.train.trainer import Sample, TrainResult, prepare, train

log = logging.getLogger(__name__)

# a rank waits this long at a collective for the others (a dead rank ends the run, not hangs it)
GROUP_TIMEOUT_S = 600


def _join(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _run_rank(rank: int, world: int, port: int, scratch: str, kwargs: dict) -> None:
    """A spawned rank: load what rank 0 wrote, train this rank's share (a failure: exit code 1)."""
    torch.set_num_threads(1)  # one core per rank
    folder = Path(scratch)
    drafter = load_drafter(folder / "drafter")
    heads = load_file(str(folder / "heads.safetensors"))
    samples = load_samples(folder / "samples.safetensors")
    _join(rank, world, port)
    code = 1
    try:
        train(drafter, heads["embed"], heads["lm_head"], samples, ranks=Ranks(rank, world, rank), progress=False,
              **kwargs)
        code = 0
    except Exception:
        traceback.print_exc()  # rank 0 reports the exit code and points here
    finally:
        exit_rank(code)


def train_ranked(drafter: Eagle3Drafter, embed: torch.Tensor, lm_head: torch.Tensor, samples: list[Sample],
                 world: int, scratch_dir: Path | None = None, progress: bool = True, **kwargs) -> TrainResult:
    """``train(drafter, embed, lm_head, samples, **kwargs)`` over ``world`` processes (this one is
    rank 0 and ends with the trained weights in ``drafter``); ``world`` 1 trains here alone. The
    ranks' files go to a fresh folder under ``scratch_dir`` (default: the system's temp dir), removed
    afterwards: they hold every sample, so put it where the sample cache lives."""
    if world <= 1:
        return train(drafter, embed, lm_head, samples, progress=progress, **kwargs)
    import torch.distributed as dist

    if dist.is_initialized():  # this process would be rank 0 of a second default group
        raise RuntimeError("training ranks need a process without a torch.distributed group; run the static "
                           "recipe in its own process (tide train --static)")
    if scratch_dir is not None:
        scratch_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="train-ranks-", dir=scratch_dir))  # unique: two runs never share
    procs = []
    try:
        prepare(samples, drafter, lm_head)  # the full-vocab argmax once, not once per rank
        save_samples(samples, scratch / "samples.safetensors")
        save_drafter(drafter, scratch / "drafter")  # fp32: every rank starts from the same weights
        # a copy of lm_head: tied to the embedding in SmolLM2, and safetensors refuses shared storage
        save_file({"embed": embed.contiguous(), "lm_head": lm_head.clone().contiguous()},
                  str(scratch / "heads.safetensors"))
        port = free_port()
        ctx = multiprocessing.get_context("spawn")  # no forked torch thread pools or open files
        procs = [ctx.Process(target=_run_rank, args=(r, world, port, str(scratch), kwargs), daemon=True)
                 for r in range(1, world)]
        for proc in procs:
            proc.start()
        _join(0, world, port)
        try:
            result = train(drafter, embed, lm_head, samples, ranks=Ranks(0, world, 0), progress=progress, **kwargs)
        finally:
            _leave()
        for proc in procs:
            proc.join()
        failed = [r for r, proc in enumerate(procs, start=1) if proc.exitcode != 0]
        if failed:
            raise RuntimeError(f"training ranks {failed} failed (their traceback is on stderr)")
        log.info("trained on %d ranks: %d steps", world, result.steps)
        return result
    finally:
        for proc in procs:  # rank 0 failed: the others would wait at a collective until its timeout
            if proc.is_alive():
                proc.terminate()
            proc.join()
        shutil.rmtree(scratch, ignore_errors=True)
