"""What the model runner decides at start-up, as functions of numbers: its threads, whether
our native kernels and packed weights run, the KV pool's blocks, the decode workspace's
rows, the decode graphs' mode and where whole prompts leave our prefill kernel for SDPA.

`ModelRunner.__init__` measures (free memory, what the native kernels built, the CPU's
capability) and applies these; here nothing loads a model or allocates, and only `num_cpus`
asks the OS anything.
"""

import os

import torch

from workers.models.model_config import ModelConfig
from workers.runner.kv_int8 import SCALE_DTYPE

NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what workers.runner.native's kernels take
AVX2_SDPA_PROMPTS_OVER = 1024  # whole prompts longer than this: SDPA on an AVX2 CPU


def num_cpus() -> int:
    """The CPUs this process may run on (its affinity), else all the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def plan_threads(configured: int | None, num_cpus: int, cap: int = 8) -> int:
    """torch threads: the configured number, else the CPUs we may run on, at most `cap`."""
    if configured is not None:
        return max(configured, 1)
    return max(min(num_cpus, cap), 1)


def plan_max_model_len(configured: int | None, max_context: int) -> int:
    """Tokens a sequence may reach: the configured length (None: no limit of its own), never
    past the model's context."""
    return min(configured or max_context, max_context)


def uses_native_kernels(enabled: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether our C++ kernels may run: asked for, on the CPU, in a dtype they take."""
    return enabled and device.type == "cpu" and dtype in NATIVE_DTYPES


def plan_packing(packed_weights: bool, onednn: bool, native_linear: bool) -> bool:
    """Whether the linear weights are packed at load (`packing.pack_weights`): asked for, and
    oneDNN takes them (`packing.can_pack`) or our linear kernel runs."""
    return packed_weights and (onednn or native_linear)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V one token takes in the cache, over all layers: `dtype`'s size per
    number ("auto"), or with an int8 cache one byte per number and a bf16 scale per head
    (`workers.runner.kv_int8`)."""
    if kv_cache_dtype == "int8":
        per_head = cfg.head_dim + SCALE_DTYPE.itemsize
    else:
        per_head = cfg.head_dim * dtype.itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head


def plan_num_kv_blocks(
    available_bytes: int,
    fraction: float,
    bytes_per_token: int,
    block_size: int,
    max_useful_tokens: int,
    budget_bytes: int | None = None,
) -> int:
    """KV blocks within `fraction` of the free memory and `budget_bytes` (None: no budget),
    no more than can ever be used."""
    limit = int(available_bytes * fraction)
    if budget_bytes is not None:
        limit = min(limit, budget_bytes)
    fit = limit // (bytes_per_token * block_size)
    useful = -(-max_useful_tokens // block_size)
    return max(min(fit, useful), 1)


def plan_workspace_rows(
    budget_bytes: int, bytes_per_token: int, tokens_per_row: int, max_rows: int
) -> int:
    """Decode-workspace rows: at most `max_rows` (one per sequence), within the budget,
    at least one. Decodes beyond the rows gather their blocks instead."""
    fit = budget_bytes // (bytes_per_token * tokens_per_row)
    return max(min(max_rows, fit), 1)


def plan_graph_mode(
    configured: str, device: torch.device, whole_model: bool, workspace_tokens: int
) -> str:
    """ "auto" (capture CUDA graphs), "eager" (the same buckets, run eagerly) or "off":
    graphs need the whole model here (a shard group's collectives are not captured) and
    a decode workspace; "auto" captures only on CUDA."""
    if not whole_model or workspace_tokens <= 0:
        return "off"
    if configured == "auto" and device.type != "cuda":
        return "off"
    return configured


def kv_sink_slots(graph_mode: str, block_size: int) -> int:
    """Slots past the pool in each KV tensor: decode graphs pad a step to its bucket and the
    padding rows write their K/V to a block there, which no request is ever given."""
    return block_size if graph_mode != "off" else 0


def plan_sdpa_prompts_over(cpu_capability: str) -> int | None:
    """Whole prompts longer than this go to torch's causal SDPA rather than our prefill
    kernel (None: none do).

    Our kernel runs on AVX2 8 lanes wide, and SDPA overtakes it on long whole prompts (Zen 3,
    a step of 2,048 prompt tokens, ours against SDPA: 4 x 512 fp32 1,047 vs 1,154 ms, bf16
    1,029 vs 1,182; 2 x 1,024 fp32 level, bf16 1,129 vs 1,217; 1 x 2,048 fp32 1,465 vs
    1,407, bf16 1,371 vs 1,347).
    """
    return AVX2_SDPA_PROMPTS_OVER if cpu_capability == "AVX2" else None
