"""The grammar cache on real builds: a tenant's new schemas cost heap within the cache's
byte bounds and displace only its own entries; tenants never share an entry."""

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
