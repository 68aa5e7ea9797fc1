#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, lint included; then the CPU kernel's and the decode
# step's tests again under each lower instruction set this CPU can run (QUANTKIT_CPU_ISA), so an AVX512
# machine also proves the AVX2 and generic paths and an AVX2 machine the generic one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check quantkit tests benchmarks cli.py
# the llama.cpp proof of the GGUF export must run here, not skip
QUANTKIT_REQUIRE_ENGINES=1 .venv/bin/python -m pytest -q
lower=$(.venv/bin/python -c "from quantkit.runtime.cpu_kernel import main; raise SystemExit(main(['lower-isas']))")
for isa in $lower; do
  echo "== the kernel and decode tests again with QUANTKIT_CPU_ISA=$isa"
  QUANTKIT_CPU_ISA=$isa .venv/bin/python -m pytest -q tests/test_cpu_kernel.py tests/test_step_ops.py \
    tests/test_model_forward.py tests/test_model_delta_rule.py tests/test_runtime_kernels.py tests/test_route.py
done
