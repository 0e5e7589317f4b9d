#!/usr/bin/env bash
# Run the CPU test suite from source on the oldest torch and triton the packages declare
# (torch 2.11 with triton 3.6: also what the lent GPU machine has), in a throwaway venv.
# Not part of CI: it downloads a second torch (several GB).
#   bash scripts/check_torch_floor.sh [pytest args...]   (default: every test folder)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
uv venv --quiet --python 3.11 "$work/venv"
# numpy < 2.3: the Triton 3.6 interpreter turns 1-element arrays into Python scalars, which
# numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars").
uv pip install --quiet --python "$work/venv/bin/python" \
  "torch==2.11.*" "triton==3.6.*" "numpy<2.3" safetensors pyyaml pytest
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)"
"$work/venv/bin/python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
# In this process (-o addopts): the venv has no pytest-xdist.
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers" \
  "${@:-tests}"
