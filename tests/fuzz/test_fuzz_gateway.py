"""Generated hostile requests against a real gateway over a real Redis, with a real worker
(the tiny demo checkpoint) behind it.

Per request: the answer rules of `tests.fuzz.harness` (no status >= 500 at all: requests
go one at a time against generous limits, so even a 503 with Retry-After would be bad
input turned into "overload"); then, once the gateway has reconciled (a bounded poll of
GET /v1/usage), the tenant's `tokens_today` equals the sum of `usage.total_tokens` its
clients were told (errors count 0), no concurrency slot is held, and the worker is ready
with nothing resident.

Two tenants: requests whose client is told its usage (non-streaming, or streaming with
`stream_options.include_usage`) go to `counted`, whose Redis counter is checked exactly;
the rest (streams without the usage chunk, bodies that are not JSON objects) go to
`uncounted`, checked for answers and slots only. Outcomes matching `harness.KNOWN_ISSUES`
(bugs reported and kept as strict xfails in test_regressions.py) are counted apart.
"""

import time

import httpx
import pytest
from hypothesis import given

from tests.fuzz.harness import HANG_S, FuzzStats, busy_load, fuzz_groups, fuzz_timeout_s, send
from tests.fuzz.strategies import cases

MODELS = ("small", "auto")  # the pool, and `auto` (the default pool, route `fallback`)


def settled_usage(
    client: httpx.Client, key: str, tokens: int | None, timeout_s: float = 5.0
) -> tuple[bool, dict]:
    """Poll the tenant's /v1/usage until no slot is held and (unless `tokens` is None)
    `tokens_today` equals `tokens`: (True, usage), or (False, last usage) past the bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = client.get("/v1/usage", headers={"authorization": f"Bearer {key}"}).json()
        done = usage["concurrent_requests"] == 0 and tokens in (None, usage["tokens_today"])
        if done or time.monotonic() > deadline:
            return done, usage
        time.sleep(0.005)


@pytest.mark.timeout(fuzz_timeout_s())
def test_gateway_survives_generated_requests_and_charges_what_it_reports(gateway, worker):
    url, keys = gateway
    vocab = httpx.get(f"{worker.url}/load").json()["vocab_size"]
    groups, run_seed = fuzz_groups()
    stats = FuzzStats("gateway", seed=run_seed)
    expected = {"counted": 0}  # tokens_today the counted tenant should show
    with httpx.Client(base_url=url, timeout=httpx.Timeout(HANG_S, connect=5.0)) as client:

        def check(case):
            tenant = "counted" if case.countable else "uncounted"
            outcome = send(client, case, keys[tenant])
            known = stats.record(case, outcome)
            if tenant == "counted":
                expected["counted"] += outcome.told_tokens
            ok, usage = settled_usage(client, keys[tenant], None if known else expected.get(tenant))
            if known and tenant == "counted":  # charged what it relayed, told nothing
                expected["counted"] = usage["tokens_today"]
            if not ok:
                if usage["concurrent_requests"]:
                    stats.slots_left += 1
                    stats.fail(f"concurrency slot left: {usage}", case)
                if tenant == "counted" and usage["tokens_today"] != expected["counted"]:
                    stats.mis_charges += 1
                    charged = usage["tokens_today"] - (expected["counted"] - outcome.told_tokens)
                    stats.fail(
                        f"mis-charge: told {outcome.told_tokens} tokens, charged {charged} "
                        f"(status {outcome.status})",
                        case,
                    )
                    # Judge the next request on its own (the mis-charge is counted above).
                    expected["counted"] = usage["tokens_today"]
            load = busy_load(client, worker.url)
            if load is not None:
                stats.stalls += 1
                stats.fail(f"worker not idle after the request: {load}", case)

        for kind, first, decorate in groups:
            decorate(given(case=cases(vocab, MODELS, kind, first))(check))()

        stats.tokens_expected = expected["counted"]
        _, usage = settled_usage(client, keys["counted"], None)
        stats.tokens_counted = usage["tokens_today"]
        _, other = settled_usage(client, keys["uncounted"], None)
        stats.slots_left += usage["concurrent_requests"] + other["concurrent_requests"]
        final = busy_load(client, worker.url, timeout_s=10)
        ready = client.get("/ready").status_code
    if final is not None or ready != 200:
        stats.stalls += 1
        stats.failures.append({"problem": f"not ready at the end: {final} {ready}", "request": ""})
    stats.report()
    assert stats.ok, stats.summary() + "".join(f"\n{f}" for f in stats.failures)
