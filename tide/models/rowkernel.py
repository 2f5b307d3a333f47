"""The few-row linear kernel (``csrc/linear_rows.c``): build once, load with ctypes, call.

Why: on one CPU core a 1-token decode and a γ+1-token verify both stream every weight from
memory; torch's kernels read them far slower for 2..8 rows than for one (MKL sgemm ~2x a gemv at
M=5, oneDNN with prepacked weights ~1.3-1.4x), and that ratio is what speculative decoding pays
per verify. The C kernel reads each block of weight rows once and applies it to every row of x,
so M = 2..5 costs close to M = 1, and each row's result does not depend on M (bitwise).

Steps of ``load``:
1. skip (return None) unless the CPU is x86-64 with AVX2 + FMA, a C compiler is on PATH, and
   ``TIDE_ROW_KERNEL`` is not ``0``;
2. compile the source with ``-O3 -mavx2 -mfma -ffp-contract=off`` into
   ``<TIDE_HOME>/kernels/linear_rows-<source digest>.so``, via a temporary file and a rename so
   concurrent processes (engine, retrain job) never load a half-written library;
3. ``ctypes.CDLL`` it once per process; ctypes drops the GIL during the call, so the engine's
   background threads (capture, HTTP) keep running while a forward is in the kernel.
Any failure logs one warning and returns None: callers keep torch's kernels.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from tide.config import default_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "linear_rows.c"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-shared", "-fPIC"]
ENV_SWITCH = "TIDE_ROW_KERNEL"

_lock = threading.Lock()
_loaded: dict[str, object] = {}


class RowKernel:
    """``y = x @ w.T`` for contiguous float32 ``x`` [M, K] and ``w`` [N, K] in float32 or bfloat16
    (accumulated in float32 either way; a bf16-valued float32 ``w`` gives bitwise the same ``y``)."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self._fns = {torch.float32: lib.tide_linear_rows_f32, torch.bfloat16: lib.tide_linear_rows_bf16}
        for fn in self._fns.values():
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                           ctypes.c_void_p]

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        fn = self._fns.get(w.dtype)
        if fn is None or x.dtype != torch.float32 or x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"row kernel takes float32 x [M, K] and float32/bfloat16 w [N, K], got "
                             f"{tuple(x.shape)} {x.dtype} and {tuple(w.shape)} {w.dtype}")
        if not w.is_contiguous():
            raise ValueError("row kernel weights must be contiguous")
        x = x.contiguous()
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        fn(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], y.data_ptr())
        return y


def cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(flags.split())
    return "avx2" in words and "fma" in words


def _compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernel (if its digest-named library is not there yet); returns its path."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:16]
    out_dir = out_dir or default_home() / "kernels"
    target = out_dir / f"linear_rows-{digest}.so"
    if target.exists():
        return target
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler on PATH (set CC, or install gcc)")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".linear_rows-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# query rows one pass over the weights serves (MAX_BLOCK_ROWS in csrc/linear_rows.c): a verify of
# up to this many tokens streams the weights once
PASS_ROWS = 6


def load() -> RowKernel | None:
    """The process's kernel, or None where it cannot run here (reason logged once)."""
    with _lock:
        if "kernel" in _loaded:
            return _loaded["kernel"]  # type: ignore[return-value]
        kernel = None
        if os.environ.get(ENV_SWITCH, "1") == "0":
            log.info("row kernel disabled by %s=0: torch kernels for every linear", ENV_SWITCH)
        elif not cpu_supported():
            log.info("row kernel needs an x86-64 CPU with AVX2 and FMA: torch kernels for every linear")
        else:
            try:
                path = build()
                kernel = RowKernel(ctypes.CDLL(str(path)), path)
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("row kernel unavailable (%s): torch kernels for every linear", exc)
        _loaded["kernel"] = kernel
        return kernel
