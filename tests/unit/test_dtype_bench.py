"""`switchyard bench dtype` runs end to end on a small checkpoint and reports its parts
(a smoke run: the figures themselves come from the real model, docs in the README)."""

import json

from benchmarks.dtype_bench import PROMPTS, DtypeBenchOptions, run_dtype_bench


def test_the_dtype_bench_compares_and_writes_its_report(demo_dir, tmp_path, capsys) -> None:
    out = tmp_path / "dtype.json"
    result = run_dtype_bench(DtypeBenchOptions(demo_dir, out, num_tokens=4))
    assert json.loads(out.read_text()) == result
    assert result["num_prompts"] == len(PROMPTS) and 0 <= result["identical"] <= len(PROMPTS)
    assert all(0 <= k <= 4 for k in result["tokens_before_first_difference"])
    assert 0.0 <= result["teacher_forced"]["top1_agreement"] <= 1.0
    for dtype in ("float32", "bfloat16"):
        speed = result["speed"][dtype]
        assert speed["decode_step_ms_batch1"] > 0 and speed["prefill_tokens_per_s"] > 0
    assert "identical continuations" in capsys.readouterr().out
