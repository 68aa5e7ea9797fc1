#!/bin/bash
# One greedy generation on the kernel's one-call stack route and on its fused ops per layer, alternated ROUNDS
# times: what retiring the C++ stack (qk_layers.cpp) would cost a single stream. Usage:
#   bash benchmarks/one-engine/stack_vs_fused.sh MODEL [ROUNDS]
set -euo pipefail
model=$1 rounds=${2:-5}
for _ in $(seq "$rounds"); do
  for route in stack fused; do
    QUANTKIT_ROUTE=$route .venv/bin/quantkit generate "$model" --max-tokens 96 --temperature 0 --mtp 0 --threads 2 \
      --prompt "List the files in the current directory and explain each one." --json 2>/dev/null |
      python3 -c "import json, sys; d = json.load(sys.stdin); print(d['route']['name'], round(d['generation_tps'], 2))"
  done
done
