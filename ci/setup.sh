#!/usr/bin/env bash
# Create .venv with torch (CPU build 2.13.0 unless TORCH_SPEC says otherwise)
# and this package. Used by the README, .ci/run and the workflows.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q -e .
python -c "import torch, hypothesis; print('torch', torch.__version__, '| hypothesis', hypothesis.__version__)"
