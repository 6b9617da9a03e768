"""The grammar cache on real builds and a real worker: a tenant's new schemas cost heap
within the cache's byte bounds and displace only its own entries; a cached schema is
served while another tenant's compile is in flight; a tenant's compiles in flight are
bounded (429 in the OpenAI shape, with Retry-After); /metrics shows the cache."""

import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import httpx
import llguidance
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.worker import running_worker
from workers.engine.config import EngineConfig, GrammarCacheConfig
from workers.engine.heap import heap_bytes
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import GrammarSpec

MB = 2**20


def ranges_schema(tag: str, num: int = 100) -> dict:
    """About 6 KB of bounded numbers: its build leaves about 1.7 MB of heap."""
    props = {
        f"n{k}_{tag}": {"type": "number", "minimum": -k - 0.5, "maximum": k * 1000.25}
        for k in range(num)
    }
    return {"type": "object", "properties": props, "additionalProperties": False}


def small_schema(tag: str) -> dict:
    props = {f"field_{tag}": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}}
    return {"type": "object", "properties": props, "required": list(props)}


def test_distinct_schemas_leave_the_heap_within_the_cache_bounds(demo_dir):
    cfg = GrammarCacheConfig(max_bytes=12 * MB, max_tenant_bytes=8 * MB, max_lexer_states=512)
    engine = LLMEngine.from_pretrained(
        demo_dir, EngineConfig(num_kv_blocks=32, block_size=16, grammar_cache=cfg)
    )

    def compile_for(tenant: str, schema: dict) -> None:
        params = SamplingParams(max_tokens=4)
        spec = GrammarSpec.from_schema(schema)
        engine.make_request(prompt="x", params=params, tenant=tenant, grammar=spec)

    compile_for("victim", small_schema("v"))  # the token table is built here, uncharged
    before = heap_bytes()
    for i in range(30):  # about 50 MB of grammars were they all kept
        compile_for("flood", ranges_schema(str(i)))
    grown = heap_bytes() - before
    stats = engine.grammars.stats
    assert stats.num_compiles == 31 and stats.num_evictions > 0
    assert stats.tenant_bytes["flood"] <= cfg.max_tenant_bytes
    assert stats.num_bytes <= cfg.max_bytes
    assert grown < cfg.max_tenant_bytes, f"the heap grew {grown / MB:.1f} MB"
    # Each entry is charged its build (measured, about 1.7 MB) plus its lexer's room.
    per_entry = stats.tenant_bytes["flood"] / (stats.num_entries - 1)
    assert 1.2 * MB + 512 * 1024 < per_entry < 2.5 * MB + 512 * 1024
    # The flood displaced none of the victim's entries.
    assert engine.grammars.cached(GrammarSpec.from_schema(small_schema("v")), "victim")


def test_a_tenant_never_gets_another_tenants_entry(demo_dir):
    engine = LLMEngine.from_pretrained(demo_dir, EngineConfig(num_kv_blocks=32, block_size=16))
    spec = GrammarSpec.from_schema(small_schema("shared"))
    engine.grammars.guide(spec, "a")
    assert engine.grammars.cached(spec, "b") is None
    engine.grammars.guide(spec, "b")
    assert engine.grammars.stats.num_compiles == 2


# -- a real worker, its builds held at a gate ------------------------------------------


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


@pytest.fixture
def gate(monkeypatch):
    g = BuildGate(monkeypatch)
    yield g
    g.release.set()


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


def test_a_tenants_compiles_in_flight_are_bounded_with_a_429(worker, gate):
    with ThreadPoolExecutor(4) as pool:
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
    assert samples[(p + "limit_bytes", model)] == GrammarCacheConfig().max_bytes
    assert samples[(p + "tenant_limit_bytes", model)] == GrammarCacheConfig().max_tenant_bytes
    tenant = (("model_name", "small"), ("tenant", "metered"))
    assert samples[(p + "tenant_bytes", tenant)] > 0
    assert samples[("switchyard_worker_grammar_compiles_total", model)] >= 1
