"""Generated hostile requests against a real worker: no 5xx, OpenAI-shaped refusals, no
hang, and the worker ready with nothing resident after each request and at the end."""

import httpx
import pytest
from hypothesis import given

from tests.fuzz.harness import HANG_S, FuzzStats, busy_load, fuzz_groups, fuzz_timeout_s, send
from tests.fuzz.strategies import cases

MODELS = ("small", "demo")  # the worker's served names


@pytest.mark.timeout(fuzz_timeout_s())
def test_worker_survives_generated_requests(worker):
    vocab = httpx.get(f"{worker.url}/load").json()["vocab_size"]
    groups, run_seed = fuzz_groups()
    stats = FuzzStats("worker", seed=run_seed)
    with httpx.Client(base_url=worker.url, timeout=httpx.Timeout(HANG_S, connect=5.0)) as client:

        def check(case):
            stats.record(case, send(client, case, key="unused"))
            load = busy_load(client, worker.url)
            if load is not None:
                stats.stalls += 1
                stats.fail(f"worker not idle after the request: {load}", case)

        for kind, first, decorate in groups:
            decorate(given(case=cases(vocab, MODELS, kind, first))(check))()
        final = busy_load(client, worker.url, timeout_s=10)
    if final is not None:
        stats.stalls += 1
        stats.failures.append({"problem": f"worker not idle at the end: {final}", "request": ""})
    stats.report()
    assert stats.ok, stats.summary() + "".join(f"\n{f}" for f in stats.failures)
