#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, lint included, on every core (pytest-xdist).
# Every instruction set this CPU can run is proven in this one run: the `kernel_table` / `each_table` fixtures
# (tests/conftest.py) force each lower op table in-process, and the forced-switch tests run QUANTKIT_CPU_ISA=each
# value in a fresh process, so an AVX512 machine also proves the AVX2 and generic paths.
# The fast tier for everyday work: .venv/bin/python -m pytest -n auto -m "not slow" (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check quantkit tests benchmarks cli.py
# the package graph runs one way (the contracts in pyproject.toml [tool.importlinter])
.venv/bin/lint-imports
# the llama.cpp proof of the GGUF export must run here, not skip
QUANTKIT_REQUIRE_ENGINES=1 .venv/bin/python -m pytest -q -n auto --dist loadgroup --timeout 1200 --durations 20
