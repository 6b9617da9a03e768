#!/usr/bin/env bash
# Set up, write the demo checkpoints, and generate text through the engine.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/switchyard models make-demo --out models
.venv/bin/switchyard generate --model models/large --max-tokens 48 "Switchyard serves language models"
.venv/bin/switchyard generate --model models/small --chat --temperature 0.8 --seed 7 --max-tokens 48 "Hello!"
