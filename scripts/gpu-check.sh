#!/usr/bin/env bash
# The GPU check in one command (benchmarks/gpu.py says what it does): set up if needed, then
# `python -m benchmarks.gpu` (from this checkout's root) under a time limit; writes reports/bench-gpu.{md,json}. Extra arguments go to
# the bench (e.g. --new-tokens 64). Exit: the bench's (0 all checks pass, 1 a check failed, 2 an error such
# as no CUDA GPU), 124 when it ran past the limit ($QUANTKIT_GPU_CHECK_SECONDS, default 480).
# Each plan loads on the route the runtime chooses; the all-GPU plan also on the cuda-graph route.
#
# Python, the first that applies: $QUANTKIT_PYTHON; .venv when its torch sees CUDA; the system python3
# when its torch sees CUDA and it has quantkit's dependencies (quantkit itself from this checkout); a
# .venv-gpu on top of that python3 (--system-site-packages: a GPU machine's CUDA torch is kept, never
# replaced by setup.sh's CPU wheel); else scripts/setup.sh's .venv (CPU torch: the bench then says
# "no CUDA GPU" in one line).
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT=${QUANTKIT_GPU_CHECK_SECONDS:-480}
has_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
has_quantkit() { "$1" -c "import quantkit.cli, quantkit.runtime, transformers, safetensors" 2>/dev/null; }
if [ -n "${QUANTKIT_PYTHON:-}" ]; then
  PY=$QUANTKIT_PYTHON
elif [ -x .venv/bin/python ] && has_cuda .venv/bin/python && has_quantkit .venv/bin/python; then
  PY=.venv/bin/python
elif command -v python3 >/dev/null && has_cuda python3; then
  if PYTHONPATH="$PWD" has_quantkit python3; then
    PY=python3
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    [ -x .venv-gpu/bin/python ] || python3 -m venv --system-site-packages .venv-gpu
    has_quantkit .venv-gpu/bin/python || .venv-gpu/bin/pip install -q -e ".[bnb]"
    PY=.venv-gpu/bin/python
  fi
else
  bash scripts/setup.sh
  PY=.venv/bin/python
fi
# the CPU kernel the GPU+CPU placement computes its experts with: built once, outside the time limit
"$PY" -c "from quantkit.kernels.cpu import main; raise SystemExit(main(['build']))" || true
exec timeout --signal=INT --kill-after=30 "$LIMIT" "$PY" -m benchmarks.gpu "$@"
