"""The speculative scenario of `switchyard bench engine` on the tiny demo checkpoint: both
loads run off and on side by side, with the same greedy output, and the table reports
them."""

from benchmarks.engine_spec import run_speculative, speculative_section, speculative_spec


def test_both_loads_run_off_and_on_and_are_reported(demo_dir):
    spec = {**speculative_spec(demo_dir, "float32", quick=True), "max_tokens": 12}
    out = run_speculative(spec)
    assert set(out["loads"]) == {"copy", "chat"}
    for load in out["loads"].values():
        assert load["all_same_output"] and load["output_tokens"] > 0
        assert load["tok_s_off"] > 0 and load["tok_s_on"] > 0
        assert load["tokens_per_step_off"] == 1.0
        assert all(r["steps_on"] <= r["steps_off"] for r in load["requests"])
    table = "\n".join(speculative_section(out, "float32"))
    assert "copy-heavy" in table and "free chat" in table and "target >= 1.5x" in table


def test_the_workspace_comparison_runs_a_third_engine_without_one(demo_dir):
    spec = {**speculative_spec(demo_dir, "float32", quick=True, workspace=True), "max_tokens": 8}
    out = run_speculative(spec)
    (chat,) = out["loads"].values()
    assert chat["all_same_output"] and chat["tok_s_on_no_workspace"] > 0
    assert "with no decode workspace" in "\n".join(speculative_section(out, "float32"))
