"""The levers scenario of `switchyard bench engine` on a tiny checkpoint: every
configuration is timed, each one still computes the same greedy tokens, and the engine
is left on its fast path."""

from benchmarks.engine_levers import CONFIGS, fast_path_parts, levers_section, run_levers
from benchmarks.engine_systems import _engine, greedy_params
from tests.integration.test_engine_correctness import make_prompts


def test_every_configuration_is_timed_and_reported(llama_dir):
    spec = {
        "ckpt": str(llama_dir),
        "dtype": "float32",
        "decode_batches": [3],
        "decode_context": 12,
        "rounds": 1,
        "steps_per_round": 2,
    }
    out = run_levers(spec)
    (point,) = out["points"]
    assert set(point["step_ms"]) == set(CONFIGS)
    assert all(ms > 0 for ms in point["step_ms"].values())
    table = "\n".join(levers_section(out))
    assert all(f"{c} ms" in table for c in CONFIGS)


def test_each_configuration_generates_the_fast_paths_tokens(llama_dir):
    engine = _engine(str(llama_dir), num_blocks=128, budget=256, max_seqs=8)
    parts = fast_path_parts(engine)
    assert parts is not None
    prompts = make_prompts(4, seed=5)
    params = greedy_params(12)
    want = [r.token_ids for r in engine.generate(prompts, params)]
    for config in CONFIGS:
        parts.apply(engine, config)
        assert [r.token_ids for r in engine.generate(prompts, params)] == want, config
    parts.apply(engine, "fast path")
    assert engine.runner.decode_kernel is parts.kernel


def test_the_workload_breakdown_covers_every_step_by_kind(llama_dir):
    """The throughput section's table of step kinds: each step counted once, under its
    kind, with the runner's time and the bounds of those steps."""
    from benchmarks.engine_bench import _by_kind_table
    from benchmarks.engine_systems import STEP_KINDS, CostMeter
    from benchmarks.roofline import Machine

    engine = _engine(str(llama_dir), num_blocks=256, budget=64, max_seqs=20)
    meter = CostMeter(engine)
    # 20 prompts of 12-60 tokens through a 64-token budget: prompt-chunk steps, then
    # decodes at 20 rows (16-47) that fall below 16 as the shorter outputs end.
    prompts = make_prompts(20, seed=6, lo=12, hi=60)
    engine.generate(prompts, [greedy_params(20 + 2 * i) for i in range(20)])
    rows = meter.by_kind(Machine(gemm_flops=1e11, bandwidth=2e10))
    assert [r["kind"] for r in rows] == [STEP_KINDS[0], STEP_KINDS[2], STEP_KINDS[3]]
    assert sum(r["steps"] for r in rows) == len(meter.steps) == len(meter.seconds)
    assert abs(sum(r["measured_s"] for r in rows) - sum(meter.seconds)) < 1e-9
    assert all(r["measured_s"] > 0 and r["roofline_s"] <= r["serial_s"] for r in rows)
    table = _by_kind_table(rows)
    assert "measured / no-overlap" in table and STEP_KINDS[2] in table


def test_the_report_header_names_only_the_scenarios_that_ran(tmp_path):
    from benchmarks.engine_bench import BenchOptions, _dtype_summary

    def summary(scenarios, dtypes=("float32", "bfloat16")):
        return _dtype_summary(
            BenchOptions(out_dir=tmp_path, scenarios=list(scenarios), dtypes=list(dtypes))
        )

    assert summary(["prefix", "chunked"]) == "prefix, chunked in float32"
    assert summary(["throughput", "decode"], ["bfloat16"]) == "throughput, decode in bfloat16"
    assert summary(["throughput", "chunked"]) == (
        "throughput in float32, bfloat16; chunked in float32"
    )
