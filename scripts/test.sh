#!/usr/bin/env bash
# Set up (idempotent), lint, check the package layering, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/lint-imports
.venv/bin/python -m pytest -q "$@"
