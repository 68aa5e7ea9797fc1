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
  # the longest step of a fresh set-up: said before it starts, and pip's own download bar on a terminal
  echo "installing torch ${QUANTKIT_TORCH:-2.13.0} into .venv (a large download: minutes)..." >&2
  .venv/bin/pip install --progress-bar on "torch==${QUANTKIT_TORCH:-2.13.0}"
fi
echo "installing quantkit (extras: ${1:-bnb}) into .venv..." >&2
.venv/bin/pip install -q -e ".[${1:-bnb}]"
echo "building quantkit's CPU kernel (once; needs gcc)..." >&2
# quantkit's CPU kernel (int4/int8 MoE decode; needs gcc): built once into ~/.cache/quantkit/kernels
# (or $QUANTKIT_KERNEL_CACHE). A failed build prints one line and set-up goes on: the runtime then keeps
# torch's kernels.
# (called as a function: `python -m` on a module the package itself imports makes runpy warn)
.venv/bin/python -c "from quantkit.kernels.cpu import main; raise SystemExit(main(['build']))" || true
# The tests prove the GGUF export with llama.cpp itself: llama-cpp-python builds from its sdist (about
# 4 minutes on 2 cores, once). Pinned to the release whose llama.cpp knows qwen35moe. Built without AMX: on
# Sapphire Rapids-class CPUs its AMX matmul segfaults on the first multiplication (ggml-org/llama.cpp#20824;
# here on every GGUF the tests make), so -mno-amx-* (GCC lets them win over -march=native) and a build that
# has AMX is rebuilt. Not from pip's wheel cache: it keys wheels by version, not by these flags.
llama_ready() {
  .venv/bin/python -c "import llama_cpp, sys; sys.exit(b'AMX_INT8 = 1' in llama_cpp.llama_print_system_info())" \
    2>/dev/null
}
if [ "${1:-bnb}" = test ] && ! llama_ready; then
  echo "building llama-cpp-python (llama.cpp for the GGUF export proof, ~4 min)..." >&2
  .venv/bin/pip uninstall -q -y llama-cpp-python 2>/dev/null || true
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  CFLAGS="$no_amx ${CFLAGS:-}" CXXFLAGS="$no_amx ${CXXFLAGS:-}" CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
    .venv/bin/pip install -q --no-cache-dir "llama-cpp-python==${QUANTKIT_LLAMA_CPP:-0.3.36}"
fi
