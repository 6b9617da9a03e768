"""Property-based fuzzing (Hypothesis) of the worker and of the gateway in front of it.

`test_fuzz_worker.py` sends generated bodies and headers to a real worker (the tiny demo
checkpoint) over loopback; `test_fuzz_gateway.py` sends them to a real gateway over a real
Redis with a real worker behind it. Both assert no 5xx, OpenAI-shaped 4xx, no hang, a
worker left ready and empty; the gateway test also asserts the tenant's Redis token counter
equals the usage its clients were told, and that no concurrency slot is left behind.

Runs:
- default (`./scripts/test.sh`, or `pytest tests/fuzz`): a bounded, deterministic slice
  (`derandomize=True`, 300 examples per test, well under a minute together);
- long: `SWITCHYARD_FUZZ_EXAMPLES=5000 .venv/bin/pytest tests/fuzz -s` draws that many
  examples per test from a random seed it prints; `SWITCHYARD_FUZZ_SEED=<seed>` replays it.
- `SWITCHYARD_FUZZ_REPORT=path.json` writes each test's figures (inputs, 5xx, hangs,
  mis-charges, tokens told and counted, reproducers) as JSON; `-s` shows a summary line.
"""
