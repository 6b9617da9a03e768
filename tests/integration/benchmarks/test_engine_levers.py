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
