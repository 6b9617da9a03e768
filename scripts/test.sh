#!/usr/bin/env bash
# Set up (idempotent), lint, check the package layering, type-check the pure packages and
# the engine (mypy's scope is in pyproject.toml), run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/lint-imports
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
