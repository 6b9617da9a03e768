#!/usr/bin/env bash
# A tour of the running stack (start it first: ./scripts/demo.sh, in another terminal).
# Needs the OPENAI_BASE_URL and OPENAI_API_KEY lines `switchyard serve` printed at its
# first start; the admin commands find the local admin key by themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OPENAI_BASE_URL:?paste the export lines switchyard serve printed}"
: "${OPENAI_API_KEY:?paste the export lines switchyard serve printed}"
SY=.venv/bin/switchyard
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step 'model "auto": the cascade picks the pool (see x-switchyard-model and -route)'
for prompt in "Say hi." "Prove that there are infinitely many primes, step by step, with care."; do
  curl -s -D - -o /dev/null "$OPENAI_BASE_URL/chat/completions" \
    -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
    -d "{\"model\": \"auto\", \"messages\": [{\"role\": \"user\", \"content\": \"$prompt\"}], \"max_tokens\": 16}" \
    | grep -i '^x-switchyard-\(model\|route\|score\)'
done

step "streaming with the openai client"
.venv/bin/python - <<'PY'
from openai import OpenAI

stream = OpenAI().chat.completions.create(
    model="auto", messages=[{"role": "user", "content": "Write a haiku about trains."}],
    max_tokens=48, stream=True)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()
PY

step "the fleet: replicas, their state, the autoscaler's last decision"
$SY admin fleet

step "20 s of load (Poisson, 4 requests/s, 2 tenants); watch the small pool grow"
$SY load --rate 4 --duration 20 --tenants 2 --out bench-results/tour-load.json

step "the fleet after the load"
$SY admin fleet
