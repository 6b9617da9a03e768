"""`switchyard bench engine --scenarios structured`: what constrained decoding costs.

Per-step wall time of a full decode batch, unconstrained vs every row under a JSON
schema, at batch 1 and 64 (finished requests are replaced, so the batch stays full), with
the time spent filling and applying token bitmasks; the schema compile time (cold and
from the cache) and the cache hit rate over the run. Needs a checkpoint with a tokenizer:
`--model DIR`, else the `large` demo checkpoint (built offline in seconds).
"""

import statistics
import time
from pathlib import Path

from benchmarks.stats import markdown_table

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"pattern": "^[0-9]{5}$"}},
            "required": ["city"],
        },
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["name", "age", "tags", "address"],
}


def structured_checkpoint(model_dir: Path | None, out_dir: Path) -> Path:
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        return model_dir
    from workers.models.demo import make_demo_checkpoints

    demo = out_dir / "demo-checkpoints"
    if (demo / "large" / "model.safetensors").is_file():
        return demo / "large"
    return make_demo_checkpoints(demo, show_progress=False)["large"]


def _timed(fn, sink: list[float]):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    return wrapper


def _steady_steps(engine, batch: int, guided: bool, warm: int, steps: int) -> dict:
    """Step times with `batch` decoding rows, each replaced when it finishes."""
    from workers.engine.sampling_params import SamplingParams
    from workers.engine.structured import GrammarSpec

    spec = GrammarSpec.from_schema(SCHEMA) if guided else None
    count = [0]

    def add() -> None:
        count[0] += 1
        params = SamplingParams(max_tokens=96, temperature=1.0, seed=count[0], ignore_eos=True)
        engine.add_request(prompt="Describe one person as JSON:", params=params, grammar=spec)

    for _ in range(batch):
        add()
    times = []
    for i in range(warm + steps):
        t0 = time.perf_counter()
        outs = engine.step()
        if i >= warm:
            times.append(time.perf_counter() - t0)
        for o in outs:
            if o.finished:
                add()
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return {"times": times, "requests": count[0]}


def run_structured(spec: dict) -> dict:
    import workers.runner.sampler as sampler
    from workers.engine.config import EngineConfig, SchedulerConfig
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.structured import GrammarSpec

    engine = LLMEngine.from_pretrained(
        spec["ckpt"],
        EngineConfig(
            num_kv_blocks=64 * 12,
            block_size=16,
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
        ),
    )
    grammars = engine.grammars
    assert grammars is not None, "the checkpoint needs a tokenizer"
    t0 = time.perf_counter()
    grammars._tokenizer()
    tokenizer_s = time.perf_counter() - t0
    compile_ms = []
    for i in range(spec["num_schemas"]):
        schema = {**SCHEMA, "title": f"schema-{i}"}
        t0 = time.perf_counter()
        grammars.guide(GrammarSpec.from_schema(schema))
        compile_ms.append(1000 * (time.perf_counter() - t0))
    t0 = time.perf_counter()
    grammars.guide(GrammarSpec.from_schema({**SCHEMA, "title": "schema-0"}))
    cached_ms = 1000 * (time.perf_counter() - t0)
    fill: list[float] = []
    apply: list[float] = []
    sampler.fill_bitmask = _timed(sampler.fill_bitmask, fill)
    sampler.apply_bitmask = _timed(sampler.apply_bitmask, apply)
    rows = []
    warm, steps = spec["warm_steps"], spec["steps"]
    for batch in spec["batches"]:
        # Rounds alternate, and medians are reported: a shared CPU's noise hits both alike.
        free, guided, documents = [], [], 0
        fill.clear()
        apply.clear()
        for _ in range(spec["rounds"]):
            free += _steady_steps(engine, batch, False, warm, steps)["times"]
            con = _steady_steps(engine, batch, True, warm, steps)
            guided += con["times"]
            documents += con["requests"] - batch
        base_ms = 1000 * statistics.median(free)
        con_ms = 1000 * statistics.median(guided)
        rows.append(
            {
                "batch": batch,
                "unconstrained_ms": base_ms,
                "constrained_ms": con_ms,
                "overhead_pct": 100 * (con_ms / base_ms - 1),
                "fill_ms": 1000 * statistics.median(fill) if fill else 0.0,
                "apply_ms": 1000 * statistics.median(apply) if apply else 0.0,
                "mask_share_pct": 100
                * (statistics.median(fill) + statistics.median(apply))
                * 1000
                / base_ms
                if fill and apply
                else 0.0,
                "documents": documents,
            }
        )
    stats = grammars.stats
    return {
        "model": spec["ckpt"],
        "vocab_size": grammars.vocab_size,
        "tokenizer_table_s": tokenizer_s,
        "compile_ms_median": statistics.median(compile_ms),
        "compile_ms_max": max(compile_ms),
        "cached_guide_ms": cached_ms,
        "num_compiles": stats.num_compiles,
        "cache_hits": stats.num_hits,
        "cache_hit_rate": stats.hit_rate,
        "steps": rows,
    }


def structured_section(res: dict) -> list[str]:
    cols = [
        ("batch", "batch"),
        ("unconstrained_ms", "median step ms, free"),
        ("constrained_ms", "median step ms, JSON schema"),
        ("overhead_pct", "overhead %"),
        ("fill_ms", "mask fill ms"),
        ("apply_ms", "mask apply ms"),
        ("mask_share_pct", "masks / free step %"),
        ("documents", "documents finished"),
    ]
    return [
        "\n## Structured outputs (constrained decoding, llguidance)\n",
        f"Model {res['model']} (vocab {res['vocab_size']}).",
        markdown_table(res["steps"], cols),
        f"\nSchema compile: median {res['compile_ms_median']:.1f} ms, max "
        f"{res['compile_ms_max']:.1f} ms; from the cache {res['cached_guide_ms']:.3f} ms; "
        f"token table built once in {res['tokenizer_table_s']:.2f} s. Cache: "
        f"{res['num_compiles']} compiles, {res['cache_hits']} hits "
        f"(hit rate {100 * res['cache_hit_rate']:.1f}%). Target: <= 10% overhead at batch 64.",
    ]
