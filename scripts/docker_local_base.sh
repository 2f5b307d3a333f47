#!/usr/bin/env bash
# Make a Debian bookworm base image with Python 3.11 and venv from Debian packages alone, for a
# machine that reaches a Debian mirror but no container registry (k8s/Dockerfile's BASE_IMAGE).
# The host's CA bundle goes in too and pip is pointed at it (PIP_CERT), so builds from this base
# trust what the host trusts (e.g. a proxy's CA in front of the package index).
# Needs root, debootstrap and a running Docker daemon.
# Usage: scripts/docker_local_base.sh [TAG] [MIRROR]   (default tide-local/python:3.11-bookworm)
set -euo pipefail
tag="${1:-tide-local/python:3.11-bookworm}"
mirror="${2:-http://deb.debian.org/debian}"
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  bookworm "$root" "$mirror" >/dev/null
ln -sf /usr/bin/python3 "$root/usr/local/bin/python"   # the name python:3.11-slim images provide
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' - "$tag"
docker run --rm --network none "$tag" python -c 'import sys, venv; print("base image:", sys.version.split()[0])'
