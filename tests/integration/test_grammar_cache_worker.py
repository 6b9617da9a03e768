"""A real worker's grammar compiles: a cached schema is served while another tenant's
compile is in flight, a tenant's compiles in flight are bounded (429 in the OpenAI shape,
with Retry-After), and /metrics shows the cache. Builds are held at a gate (events, no
sleeps) to keep a compile in flight."""

import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import httpx
import llguidance
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.worker import running_worker

MB = 2**20


def small_schema(tag: str) -> dict:
    props = {f"field_{tag}": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}}
    return {"type": "object", "properties": props, "required": list(props)}


def ranges_schema(tag: str, num: int = 100) -> dict:
    props = {
        f"n{k}_{tag}": {"type": "number", "minimum": -k - 0.5, "maximum": k * 1000.25}
        for k in range(num)
    }
    return {"type": "object", "properties": props, "additionalProperties": False}


class BuildGate:
    """While closed, every grammar build waits at it: a compile in flight, held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.building = threading.Event()  # a build has reached the gate
        self.release = threading.Event()
        real, gate = llguidance.LLMatcher, self

        class GatedMatcher:
            def __new__(cls, *args, **kwargs):
                gate.building.set()
                assert gate.release.wait(60)
                return real(*args, **kwargs)

        for name in ("grammar_from_json_schema", "validate_grammar_with_warnings"):
            setattr(GatedMatcher, name, staticmethod(getattr(real, name)))
        monkeypatch.setattr(llguidance, "LLMatcher", GatedMatcher)


@pytest.fixture(scope="module")
def worker(demo_dir):
    with running_worker(demo_dir) as w:
        yield w


def _post(worker, schema: dict, tenant: str, timeout_s: float = 60) -> httpx.Response:
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": "JSON"}],
        "max_tokens": 4,
        "response_format": fmt,
        "cache_salt": tenant,
    }
    return httpx.post(f"{worker.url}/v1/chat/completions", json=body, timeout=timeout_s)


def test_a_cached_schema_is_served_while_another_tenants_compile_is_in_flight(worker, monkeypatch):
    victim_schema = small_schema("victim")
    assert _post(worker, victim_schema, "victim").status_code == 200  # now cached
    gate = BuildGate(monkeypatch)
    with ThreadPoolExecutor(1) as pool:
        try:
            flood = pool.submit(_post, worker, ranges_schema("held"), "flood")
            assert gate.building.wait(30)
            # The flood's compile is held mid-build; the victim's cached schema is not.
            r = _post(worker, victim_schema, "victim", timeout_s=10)
            assert r.status_code == 200, r.text
            assert not flood.done()
        finally:
            gate.release.set()
        assert flood.result().status_code == 200


def test_a_tenants_compiles_in_flight_are_bounded_with_a_429(worker, monkeypatch):
    gate = BuildGate(monkeypatch)
    with ThreadPoolExecutor(4) as pool:
        try:
            first = pool.submit(_post, worker, small_schema("a1"), "bounded")
            assert gate.building.wait(30)
            more = [pool.submit(_post, worker, small_schema(f"a{i}"), "bounded") for i in (2, 3)]
            # The bound is two: one of these waits for the lane, the other is refused at once.
            done, _ = wait(more, timeout=15, return_when=FIRST_COMPLETED)
            assert done, "neither compile was refused"
            refused = done.pop().result()
            assert refused.status_code == 429
            err = refused.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "too_many_compiles"
            assert set(err) == {"message", "type", "param", "code"}
            assert int(refused.headers["retry-after"]) >= 1
            other = pool.submit(_post, worker, small_schema("b1"), "other")  # not refused
        finally:
            gate.release.set()
        assert first.result().status_code == 200
        assert sorted(f.result().status_code for f in more) == [200, 429]
        assert other.result().status_code == 200
    assert _post(worker, small_schema("a1"), "bounded").status_code == 200  # cached


def _samples(worker) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_show_the_grammar_cache_bytes_and_entries(worker):
    assert _post(worker, small_schema("metered"), "metered").status_code == 200
    samples = _samples(worker)
    model = (("model_name", "small"),)
    p = "switchyard_worker_grammar_cache_"
    assert samples[(p + "bytes", model)] > 0
    assert samples[(p + "entries", model)] >= 1
    assert samples[(p + "limit_bytes", model)] == 512 * MB  # the defaults
    assert samples[(p + "tenant_limit_bytes", model)] == 128 * MB
    tenant = (("model_name", "small"), ("tenant", "metered"))
    assert samples[(p + "tenant_bytes", tenant)] > 0
    assert samples[("switchyard_worker_grammar_compiles_total", model)] >= 1
