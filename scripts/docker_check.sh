#!/usr/bin/env bash
# Build k8s/Dockerfile and check the image the way the manifests run it:
# - runs as uid 10001, has no C compiler and no dev extras (pytest is not importable);
# - the row kernel was compiled in the build stage and loads without compiling;
# - the engine service serves a completion on a read-only root filesystem (only /tmp writable, as the
#   Pod Security "restricted" manifests mount it) and exits 0 on SIGTERM.
# Needs a running Docker daemon. Builds with the host's network (the pip index and Debian mirror).
# Usage: scripts/docker_check.sh [--base IMAGE] [--torch-wheels DIR] [--tag TAG]
#   --torch-wheels DIR: serve torch from DIR's wheels (an offline CPU wheel) instead of
#   download.pytorch.org, over a local index on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
base=""; wheels=""; tag="tide:check"
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --torch-wheels) wheels="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
docker info >/dev/null 2>&1 || { echo "docker_check: no Docker daemon answers" >&2; exit 1; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

args=(--network host -f k8s/Dockerfile -t "$tag" --build-arg "TIDE_CODE_VERSION=$(git rev-parse HEAD 2>/dev/null || echo unknown)")
[ -n "$base" ] && args+=(--build-arg "BASE_IMAGE=$base")
index_pid=""
cleanup() { [ -n "$index_pid" ] && kill "$index_pid" 2>/dev/null; docker rm -f tide-check-engine >/dev/null 2>&1 || true; }
trap cleanup EXIT
if [ -n "$wheels" ]; then  # a directory listing per project is a valid simple index for pip
  idx="$(mktemp -d)"; mkdir "$idx/torch"; ln -s "$(realpath "$wheels")"/torch-*.whl "$idx/torch/"
  port="$(free_port)"
  python3 -m http.server "$port" --bind 127.0.0.1 --directory "$idx" >/dev/null 2>&1 & index_pid=$!
  args+=(--build-arg "TORCH_INDEX_URL=http://127.0.0.1:$port/")
fi
start=$(date +%s)
DOCKER_BUILDKIT=0 docker build -q "${args[@]}" . >/dev/null
echo "built $tag in $(( $(date +%s) - start )) s; size $(docker image inspect "$tag" --format '{{.Size}}' | awk '{printf "%.2f GiB", $1/2^30}')"

run() { docker run --rm --network none "$tag" "$@"; }
[ "$(run id -u)" = 10001 ] && echo "user: 10001"
if run sh -c 'command -v gcc || command -v cc || command -v clang' >/dev/null; then echo "FAIL: a compiler in the runtime image" >&2; exit 1; fi
echo "compiler: none"
if run python -c 'import pytest' 2>/dev/null; then echo "FAIL: dev extras (pytest) in the image" >&2; exit 1; fi
echo "dev extras: none"
run python -m tide.cli --version
run python -c 'from tide.models.rowkernel import load; k = load(); assert k is not None, "no row kernel"; print("row kernel:", k.path)'

port="$(free_port)"
docker run -d --name tide-check-engine --network host --read-only --tmpfs /tmp \
  -e TIDE_OPS__FOLLOW_REGISTRY=false -e TIDE_CAPTURE__ENABLED=false \
  "$tag" python -m tide.services.engine --port "$port" >/dev/null
for _ in $(seq 1 180); do
  curl -fs "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  [ "$(docker inspect -f '{{.State.Running}}' tide-check-engine)" = true ] || { docker logs tide-check-engine | tail -30; exit 1; }
  sleep 2
done
curl -fs "http://127.0.0.1:$port/health" >/dev/null || { docker logs tide-check-engine | tail -30; echo "FAIL: engine not healthy" >&2; exit 1; }
body=$(curl -fs "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
  -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}')
echo "completion: $(python3 -c 'import json, sys; print(repr(json.loads(sys.argv[1])["choices"][0]["text"]))' "$body")"
docker stop -t 30 tide-check-engine >/dev/null
code=$(docker inspect -f '{{.State.ExitCode}}' tide-check-engine)
[ "$code" = 0 ] || { docker logs tide-check-engine | tail -30; echo "FAIL: engine exited $code on SIGTERM" >&2; exit 1; }
echo "engine: healthy on a read-only root filesystem, a completion, exit 0 on SIGTERM"
echo "docker_check: OK"
