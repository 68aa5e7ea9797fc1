#!/usr/bin/env bash
# Create .venv with everything quantkit and its tests need, on a fresh machine.
# torch is pinned to the CPU wheel here only (the project itself takes any torch >= 2.6):
# an unpinned install would pull a multi-GB CUDA build on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==${QUANTKIT_TORCH:-2.13.0}"
fi
.venv/bin/pip install -q -e ".[${1:-test}]"
