"""Data-parallel retrains across the GPUs of one node (``torchrun``), and the one-process default.

``torchrun --nproc_per_node N -m tide.cli train --online`` starts N ranks with ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` set. Each rank trains the same drafter on its share of every
step's batches: a step takes ``world * accumulate`` batches of the seeded order, rank r the
``accumulate`` at ``r * accumulate``; DDP averages the gradients, so a step's update equals one
process accumulating the same batches (``tests/unit/train/test_distributed.py`` compares weights).
A step count that does not divide drops the epoch's last batches: every rank must take as many
steps as the others or the gradient all-reduce hangs. The backend is gloo on CPU, nccl on GPUs
(RCCL on ROCm builds, under the same name). Only rank 0 plans, evaluates, logs and registers
(``tide/train/ranks.py``); with one process nothing here communicates.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world > 1


def ranks_from_env(env=None) -> Ranks:
    """What torchrun set (one process when it did not)."""
    env = os.environ if env is None else env
    return Ranks(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def init_group(ranks: Ranks, device: torch.device) -> None:
    """Join the process group (torchrun's env:// rendezvous); nothing with one process."""
    import torch.distributed as dist

    if ranks.parallel and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def step_groups(order: list[int], ranks: Ranks, accumulate: int = 1) -> list[list[int]]:
    """This rank's batches of each step: ``accumulate`` per rank, ``world * accumulate`` per step."""
    per_step = ranks.world * accumulate
    if per_step == 1:
        return [[bi] for bi in order]
    first = ranks.rank * accumulate
    return [order[s * per_step + first: s * per_step + first + accumulate]
            for s in range(len(order) // per_step)]


def wrap(module: torch.nn.Module, ranks: Ranks, find_unused: bool = False) -> torch.nn.Module:
    """DDP around ``module`` (its parameters broadcast from rank 0); the module itself alone."""
    if not ranks.parallel:
        return module
    from torch.nn.parallel import DistributedDataParallel

    # device_ids None: the module lives on this rank's one device already
    return DistributedDataParallel(module, device_ids=None, find_unused_parameters=find_unused)


def reduce_step(ranks: Ranks, device: torch.device, loss: float, tokens: int, acc0: float) -> tuple[float, int, float]:
    """A step's figures over all ranks: mean loss, summed tokens, mean step-0 accuracy."""
    if not ranks.parallel:
        return loss, tokens, acc0
    import torch.distributed as dist

    t = torch.tensor([loss, float(tokens), acc0], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t[0]) / ranks.world, int(round(float(t[1]))), float(t[2]) / ranks.world


def from_main(ranks: Ranks, device: torch.device, value: int) -> int:
    """Rank 0's ``value`` on every rank (the time cap's horizon and stop decision must agree)."""
    if not ranks.parallel:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, 0)
    return int(t[0])


def share(ranks: Ranks, obj):
    """Rank 0's picklable ``obj`` on every rank (the plan and the parent folder)."""
    if not ranks.parallel:
        return obj
    import torch.distributed as dist

    box = [obj if ranks.is_main else None]
    dist.broadcast_object_list(box, 0)
    return box[0]


def exit_rank(code: int) -> int:
    """End a process that joined a process group with exit ``code``, without interpreter shutdown.

    Why: DDP keeps its group alive after ``destroy_process_group`` (its reducer holds it), and a
    group's worker thread may still be releasing a finished collective's tensors, which takes the
    GIL; at interpreter shutdown such a thread is stopped inside a C++ destructor and the process
    aborts (SIGABRT) though every collective finished. So: leave the group, run the exit handlers
    and flush here, then ``os._exit``. A process without a group returns ``code``.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return code
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # what shutdown would run (MLflow's and logging's flushes among them)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
