#!/usr/bin/env bash
# Set up, then run the whole stack in the foreground: `switchyard serve` fetches the model
# (SmolLM2-135M-Instruct, once), starts Redis, the gateway and the workers, and prints the
# lines to paste (base URL, API key, a curl). Ctrl-C stops everything.
# In a second terminal, ./scripts/tour.sh sends requests, shows the fleet and some load.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/switchyard serve --config configs/serve.yaml "$@"
