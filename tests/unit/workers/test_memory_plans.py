"""KV pool, decode workspace and thread planning: pure arithmetic over sizes."""

from workers.runner.runner import plan_num_kv_blocks, plan_threads, plan_workspace_rows

GIB = 2**30
SMOLLM2_FP32_TOKEN = 2 * 30 * 3 * 64 * 4  # bytes of K and V per token: 30 layers, 3 KV heads


def test_kv_pool_is_the_smallest_of_budget_free_memory_and_useful_tokens():
    per, block = SMOLLM2_FP32_TOKEN, 16
    # 30 GiB free: the old sizing took 0.3 of it (~150k tokens); a 0.5 GiB budget wins.
    blocks = plan_num_kv_blocks(30 * GIB, 0.3, per, block, 64 * 8192, budget_bytes=GIB // 2)
    assert blocks * block * per <= GIB // 2 and blocks == (GIB // 2) // (per * block)
    # Little free memory: the fraction wins over the budget.
    assert plan_num_kv_blocks(GIB, 0.1, per, block, 10**9, budget_bytes=GIB) == int(GIB * 0.1) // (
        per * block
    )
    # Few sequences of short context: what they can use wins.
    assert plan_num_kv_blocks(30 * GIB, 0.5, per, block, 4 * 100, budget_bytes=GIB) == 25
    assert plan_num_kv_blocks(30 * GIB, 0.5, per, block, 4 * 100, budget_bytes=None) == 25


def test_workspace_rows_fit_the_budget_and_never_exceed_the_sequences():
    per = SMOLLM2_FP32_TOKEN
    rows = plan_workspace_rows(GIB // 4, per, 1024, max_rows=64)
    assert rows == 5 and rows * 1024 * per <= GIB // 4
    assert plan_workspace_rows(100 * GIB, per, 1024, max_rows=64) == 64
    assert plan_workspace_rows(1, per, 1024, max_rows=64) == 1


def test_threads_default_to_the_cpus_we_may_use_capped():
    assert plan_threads(None, 2) == 2
    assert plan_threads(None, 64) == 8
    assert plan_threads(3, 64) == 3
    assert plan_threads(0, 4) == 1
