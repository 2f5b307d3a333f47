#!/usr/bin/env bash
# The SGLang engine end to end on one NVIDIA GPU with SGLang installed (pip install -e ".[sglang]"):
# starts the local stack with `tide serve --engine sglang` (SGLang server + TIDE's plugin), sends a
# few hundred requests, checks their capture records land in Parquet, registers and promotes a second
# drafter while requests run, checks no request failed across the swap, and prints acceptance
# (tokens per target forward) by drafter version before and after. Steps: tide/services/sglang_check.py.
# Usage: scripts/gpu_check_sglang.sh [--target HF_FOLDER] [--drafter FOLDER] [--requests 300] [--home DIR]
# NOT RUN YET: no machine with SGLang and a GPU was available (see docs/design/sglang.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
$PY - <<'PY' || exit 2
import sys, torch
try:
    import sglang
except ImportError:
    sys.exit("gpu_check_sglang.sh: SGLang is not installed (pip install -e '.[sglang]')")
if not torch.cuda.is_available():
    sys.exit("gpu_check_sglang.sh: no CUDA GPU visible")
from tide.engine.sglang.server_args import version_supported
if not version_supported(sglang.__version__):
    sys.exit(f"gpu_check_sglang.sh: SGLang {sglang.__version__} is outside the plugin's supported range")
PY
# the plugin is found through TIDE's entry point: make sure this checkout's metadata is installed
$PY -m pip install -q --no-deps -e .
exec $PY -m tide.services.sglang_check "$@"
