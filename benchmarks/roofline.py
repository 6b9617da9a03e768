"""The physical limit of an engine step on this machine: bytes moved and FLOPs, as pure
arithmetic, plus the two measurements (GEMM peak, streaming bandwidth) it is divided by.

A step's roofline time is max(bytes / bandwidth, FLOPs / peak): the weights are read
once per step whatever the batch, every sequence reads its whole KV context once and
writes one K/V per new token, and activations go to memory and back once per layer.
A scenario's roofline is the sum over its steps; `measured / roofline` says how far the
engine is from what the memory system and the matrix units allow.

The roofline assumes that memory traffic and arithmetic overlap perfectly. `serial_s` is
the bound without overlap (bytes / bandwidth + FLOPs / peak): an engine that runs its
phases one after the other can come near it and no further.
"""

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the cost model needs (from the checkpoint's config)."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, cfg) -> "ModelShape":
        """From a `workers.model_config.ModelConfig` (duck-typed: no import)."""
        return cls(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_layers,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.vocab_size,
        )

    @property
    def layer_params(self) -> int:
        d, q, kv = self.hidden, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return d * (q + 2 * kv) + q * d + 3 * d * self.intermediate + 2 * d

    @property
    def kv_values_per_token(self) -> int:
        """K and V values per token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class StepCost:
    bytes: float
    flops: float

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(self.bytes + other.bytes, self.flops + other.flops)


def step_cost(
    m: ModelShape,
    itemsize: int,
    decode_contexts: list[int],
    prefills: list[tuple[int, int]],
    num_sampled: int,
) -> StepCost:
    """Bytes and FLOPs of one step.

    `decode_contexts`: per decoding sequence, its cached tokens before the step;
    `prefills`: per prefill chunk, (cached tokens before it, tokens in the chunk);
    `num_sampled`: rows that go through the LM head (logits in fp32).
    """
    num_tokens = len(decode_contexts) + sum(n for _, n in prefills)
    if num_tokens == 0:
        return StepCost(0.0, 0.0)
    d, q = m.hidden, m.num_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    weights = (m.num_layers * m.layer_params + m.vocab * d + d) * itemsize
    # Keys each query sees, summed over queries: a decode sees its context + itself; a
    # chunk of n after c cached tokens sees c + 1 .. c + n.
    key_reads = sum(c + 1 for c in decode_contexts) + sum(c + n for c, n in prefills)
    pairs = sum(c + 1 for c in decode_contexts) + sum(n * c + n * (n + 1) // 2 for c, n in prefills)
    kv_bytes = (key_reads + num_tokens) * m.kv_values_per_token * itemsize
    # Each layer writes and reads back: its input, qkv, attention out, o out, gate_up,
    # the activated product and the down output.
    act_per_token = m.num_layers * 2 * (3 * d + q + 2 * kv + q + 3 * m.intermediate)
    act_bytes = num_tokens * (act_per_token + d) * itemsize + num_sampled * m.vocab * 4
    linear = 2 * num_tokens * m.num_layers * (m.layer_params - 2 * d)
    head = 2 * num_sampled * m.vocab * d
    attn = 4 * pairs * m.num_heads * m.head_dim * m.num_layers
    return StepCost(weights + kv_bytes + act_bytes, float(linear + head + attn))


@dataclass(frozen=True)
class Machine:
    """What this machine does at best, measured in the same run as the engine."""

    gemm_flops: float  # FLOP/s of a 2048^3 matmul in the dtype in use
    bandwidth: float  # bytes/s of a large streaming copy (read + write counted)


def roofline_s(cost: StepCost, machine: Machine) -> float:
    return max(cost.bytes / machine.bandwidth, cost.flops / machine.gemm_flops)


def serial_s(cost: StepCost, machine: Machine) -> float:
    """The same step if moving the bytes and computing the FLOPs took turns: what an engine
    whose phases are each bound by one of the two (the linears by the matrix units, decode
    attention by memory) needs at best, one phase after the other, on the same cores."""
    return cost.bytes / machine.bandwidth + cost.flops / machine.gemm_flops


def measure_gemm_flops(dtype, size: int = 2048, repeats: int = 6) -> float:
    """Best FLOP/s of `size`^3 matmuls in `dtype` (the matrix units, if torch uses them)."""
    import torch

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - t))
    return best


def measure_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 6) -> float:
    """Best bytes/s of copying a buffer far larger than the caches (read + write)."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * num_bytes / (time.perf_counter() - t))
    return best
