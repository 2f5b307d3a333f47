#!/usr/bin/env bash
# TIDE's EAGLE3 trainer on one NVIDIA (or ROCm) GPU against the CPU, on the same captured window:
# trains the packaged static drafter on a small pack of real captured requests once on the GPU
# (bf16 autocast, fp32 master weights) and once on the CPU (fp32, today's path), evaluates both on
# the pack's held-out requests, and prints held-out simulated acceptance and training tokens/s on
# each, with the GPU/CPU ratios (bench/train_device.py). Needs only PyTorch with CUDA/ROCm,
# safetensors, PyYAML, tqdm (what a PyTorch + transformers machine has): nothing is installed and
# nothing downloaded. The pack (ignored by git; with the repo it must fit the 64 MiB a lent GPU
# machine receives) is written beforehand on a machine with
# the target cached: python -m bench.train_device --pack-out .gpu-check/pack
# Usage: scripts/gpu_check_train.sh [--pack DIR] [--epochs 4] [--json OUT] (bench/train_device.py flags)
# Budget: under 8 minutes (the CPU run is most of it; --epochs lowers it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TQDM_DISABLE=1
$PY - <<'PY' || exit 2
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check_train.sh: no GPU visible to torch {torch.__version__}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, HIP {torch.version.hip}, "
      f"{torch.cuda.get_device_name(0)}, CPU threads {torch.get_num_threads()}")
PY
PACK=".gpu-check/pack"
for ((i = 1; i <= $#; i++)); do [[ "${!i}" == "--pack" ]] && { j=$((i + 1)); PACK="${!j}"; }; done
[[ -f "$PACK/pack.safetensors" ]] || { echo "gpu_check_train.sh: no pack at $PACK (python -m bench.train_device --pack-out $PACK)"; exit 2; }
THREADS="$($PY -c 'import os; print(min(8, os.cpu_count() or 1))')"
exec timeout 470 $PY -m bench.train_device --devices cuda,cpu --threads "$THREADS" "$@"
