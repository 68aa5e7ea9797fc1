#!/usr/bin/env bash
# Create .venv with quantkit (extras: $1, default bnb; `test` adds the test tools and llama.cpp), on a fresh machine.
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
.venv/bin/pip install -q -e ".[${1:-bnb}]"
# quantkit's CPU kernel (int4/int8 MoE decode; needs gcc): built once into ~/.cache/quantkit/kernels
# (or $QUANTKIT_KERNEL_CACHE). A failed build prints one line and set-up goes on: the runtime then keeps
# torch's kernels.
# (called as a function: `python -m` on a module the package itself imports makes runpy warn)
.venv/bin/python -c "from quantkit.runtime.cpu_kernel import main; raise SystemExit(main(['build']))" || true
# The tests prove the GGUF export with llama.cpp itself: llama-cpp-python builds from its sdist (about
# 4 minutes on 2 cores, once; pip caches the wheel). Pinned to the release whose llama.cpp knows qwen35moe.
if [ "${1:-bnb}" = test ] && ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  echo "building llama-cpp-python (llama.cpp for the GGUF export proof, ~4 min)..." >&2
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" .venv/bin/pip install -q "llama-cpp-python==${QUANTKIT_LLAMA_CPP:-0.3.36}"
fi
