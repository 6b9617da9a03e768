"""The runner's start-up plans (`workers.runner.plan`): KV pool, decode workspace, threads,
kernels and graphs, as pure functions over sizes and settings."""

import torch

from workers.runner.plan import (
    AVX2_SDPA_PROMPTS_OVER,
    kv_sink_slots,
    plan_graph_mode,
    plan_max_model_len,
    plan_num_kv_blocks,
    plan_packing,
    plan_sdpa_prompts_over,
    plan_threads,
    plan_workspace_rows,
    uses_native_kernels,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")

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


def test_max_model_len_is_the_configured_length_within_the_models_context():
    assert plan_max_model_len(None, 8192) == 8192
    assert plan_max_model_len(2048, 8192) == 2048
    assert plan_max_model_len(32768, 8192) == 8192


def test_native_kernels_run_only_when_asked_on_the_cpu_in_fp32_or_bf16():
    assert uses_native_kernels(True, CPU, torch.float32)
    assert uses_native_kernels(True, CPU, torch.bfloat16)
    assert not uses_native_kernels(False, CPU, torch.float32)
    assert not uses_native_kernels(True, CUDA, torch.float32)
    assert not uses_native_kernels(True, CPU, torch.float16)


def test_weights_are_packed_when_asked_and_some_kernel_takes_them():
    assert plan_packing(True, onednn=True, native_linear=False)
    assert plan_packing(True, onednn=False, native_linear=True)
    assert not plan_packing(True, onednn=False, native_linear=False)  # bf16 on AVX2, no tiles
    assert not plan_packing(False, onednn=True, native_linear=True)


def test_graphs_need_the_whole_model_a_workspace_and_cuda_to_capture():
    assert plan_graph_mode("auto", CUDA, whole_model=True, workspace_tokens=1024) == "auto"
    assert plan_graph_mode("auto", CPU, whole_model=True, workspace_tokens=1024) == "off"
    assert plan_graph_mode("eager", CPU, whole_model=True, workspace_tokens=1024) == "eager"
    assert plan_graph_mode("eager", CPU, whole_model=False, workspace_tokens=1024) == "off"
    assert plan_graph_mode("auto", CUDA, whole_model=True, workspace_tokens=0) == "off"
    assert plan_graph_mode("off", CUDA, whole_model=True, workspace_tokens=1024) == "off"


def test_a_sink_block_past_the_pool_only_where_graphs_pad_steps():
    assert kv_sink_slots("auto", 16) == kv_sink_slots("eager", 16) == 16
    assert kv_sink_slots("off", 16) == 0


def test_long_whole_prompts_leave_our_kernel_for_sdpa_only_on_avx2():
    assert plan_sdpa_prompts_over("AVX2") == AVX2_SDPA_PROMPTS_OVER
    assert plan_sdpa_prompts_over("AVX512") is None
