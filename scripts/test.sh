#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, lint included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check quantkit tests cli.py
.venv/bin/python -m pytest -q
