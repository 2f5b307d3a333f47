"""What a retrain Job's GPU request means for its command and environment.

- ``k8s_gpu_count`` 0: ``TIDE_TRAIN__DEVICE=cpu`` (the CPU image; no GPU is asked for);
- 1 or more: ``TIDE_TRAIN__DEVICE=cuda`` and ``TIDE_TRAIN__PRECISION=bf16`` (ROCm builds name AMD
  GPUs ``cuda`` too), so a pod scheduled without a usable GPU fails with the trainer's message
  instead of training on its CPUs;
- more than 1: the command runs under ``torch.distributed.run`` with one rank per GPU
  (``tide/train/distributed.py``), and NCCL/RCCL get a memory-backed /dev/shm (the container's
  default 64 MiB is too small for their buffers).
``schedule.k8s_env`` still overrides both variables.
"""
from __future__ import annotations

from typing import Any

SHM_MOUNT = "/dev/shm"


def device_env(sc: Any) -> dict[str, str]:
    if sc.k8s_gpu_count <= 0:
        return {"TIDE_TRAIN__DEVICE": "cpu"}
    return {"TIDE_TRAIN__DEVICE": "cuda", "TIDE_TRAIN__PRECISION": "bf16"}


def ranks_argv(argv: list[str], gpu_count: int) -> list[str]:
    """``python -m MODULE ARGS`` -> ``python -m torch.distributed.run ... -m MODULE ARGS`` for N > 1."""
    if gpu_count <= 1:
        return argv
    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"schedule.command {argv!r}: a {gpu_count}-GPU retrain needs 'python -m MODULE ...' "
                         "to run it under torch.distributed.run")
    return [argv[0], "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpu_count),
            "-m", *argv[2:]]


def shm_volume(gpu_count: int) -> tuple[list, list]:
    """(volumes, mounts): a memory-backed /dev/shm when several ranks share the node."""
    if gpu_count <= 1:
        return [], []
    from kubernetes import client

    return ([client.V1Volume(name="dshm", empty_dir=client.V1EmptyDirVolumeSource(medium="Memory"))],
            [client.V1VolumeMount(name="dshm", mount_path=SHM_MOUNT)])
