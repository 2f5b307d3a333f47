"""Where a retrain runs: the device (``train.device``), the precision (``train.precision``), seeds.

- ``auto`` picks the GPU when PyTorch sees one, else the CPU. ROCm builds of PyTorch expose AMD
  GPUs as ``cuda`` too, so one name covers NVIDIA and AMD pools.
- ``cuda`` without a usable GPU is an error that says which build is installed: a retrain Job that
  asked for a GPU and got none must fail loudly, not train for an hour on the CPU.
- ``bf16`` runs the forward and backward under autocast while the optimizer keeps fp32 master
  weights (the parameters stay fp32); ``fp32`` is today's arithmetic; ``auto`` is bf16 where the
  device multiplies bf16 natively (a GPU that supports it; a CPU with AVX512-BF16 or AMX) and fp32
  elsewhere, where emulated bf16 would be slower than fp32. The exported artifact is bf16
  safetensors either way (``tide.drafter.artifact.save_drafter``).
"""
from __future__ import annotations

import contextlib
import random

import torch

from tide.config import CHOICES

DEVICES = CHOICES["train.device"]
PRECISIONS = CHOICES["train.precision"]


class DeviceError(RuntimeError):
    """The configured device cannot be used here."""


def _build_of_torch() -> str:
    if torch.version.hip:
        return f"torch {torch.__version__} (ROCm {torch.version.hip})"
    if torch.version.cuda:
        return f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    return f"torch {torch.__version__} (CPU-only build)"


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto|cpu|cuda`` -> the device this process trains on (rank ``local_rank``'s GPU)."""
    if name not in DEVICES:
        raise DeviceError(f"train.device must be one of {DEVICES}, got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"train.device is 'cuda' but no GPU is usable: {_build_of_torch()}, "
                          f"torch.cuda.is_available() is False (is the GPU requested and the image's "
                          f"PyTorch built for it: CUDA for nvidia.com/gpu, ROCm for amd.com/gpu?)")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceError(f"rank {local_rank} has no GPU: {count} visible ({_build_of_torch()})")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 natively (not emulated through fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_precision(precision: str, device: torch.device) -> str:
    """``fp32|bf16|auto`` -> the arithmetic a step runs in on ``device`` (``fp32`` or ``bf16``)."""
    if precision not in PRECISIONS:
        raise DeviceError(f"train.precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    return precision


def autocast(device: torch.device, precision: str):
    """The context the forward and backward run in: bf16 autocast, or nothing for fp32."""
    if resolve_precision(precision, device) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def seed_all(seed: int) -> None:
    """Python, CPU and every GPU generator: two runs of one config draw the same numbers."""
    random.seed(seed)
    torch.manual_seed(seed)  # seeds the CUDA generators too
