#!/usr/bin/env bash
# SGLang's Python package for the CPU tests of the SGLang plugin (tests/unit/engine/sglang/), in its
# own folder so the main environment keeps torch 2.13.0 CPU and its transformers unbroken.
# Idempotent: a stamp holds the sha256 of the requirements file; a changed file reinstalls.
# The tests find the folder through TIDE_SGLANG_CPU_SITE (default below). GPU machines install
# `tide[sglang]` instead: a normal SGLang install with its CUDA kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python3 -m pip}"
REQ=scripts/sglang-cpu-requirements.txt
SITE="${TIDE_SGLANG_CPU_SITE:-${TIDE_HOME:-$HOME/.cache/tide}/sglang-cpu}"
WANT="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [ -f "$SITE/.stamp" ] && [ "$(cat "$SITE/.stamp")" = "$WANT" ]; then
  exit 0
fi
rm -rf "$SITE.tmp"
$PIP install -q --no-deps --target "$SITE.tmp" -r "$REQ"
echo "$WANT" > "$SITE.tmp/.stamp"
rm -rf "$SITE"
mv "$SITE.tmp" "$SITE"
echo "install_sglang_cpu.sh: SGLang for the plugin's CPU tests in $SITE"
