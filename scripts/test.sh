#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, lint included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check quantkit tests cli.py
# the llama.cpp proof of the GGUF export must run here, not skip
QUANTKIT_REQUIRE_ENGINES=1 .venv/bin/python -m pytest -q
