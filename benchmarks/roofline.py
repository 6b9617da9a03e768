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
        """From a `workers.models.model_config.ModelConfig` (duck-typed: no import)."""
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
    weight_bytes: float | None = None,
) -> StepCost:
    """Bytes and FLOPs of one step.

    `decode_contexts`: per decoding sequence, its cached tokens before the step;
    `prefills`: per prefill chunk, (cached tokens before it, tokens in the chunk);
    `num_sampled`: rows that go through the LM head (logits in fp32); `weight_bytes`: the
    bytes of the weights as held, where they are not parameters x `itemsize` (quantized
    linear layers: `ModelRunner.weight_bytes` plus the norms).
    """
    num_tokens = len(decode_contexts) + sum(n for _, n in prefills)
    if num_tokens == 0:
        return StepCost(0.0, 0.0)
    d, q = m.hidden, m.num_heads * m.head_dim
    kv = m.num_kv_heads * m.head_dim
    weights = (m.num_layers * m.layer_params + m.vocab * d + d) * itemsize
    if weight_bytes is not None:
        weights = weight_bytes
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

    gemm_flops: float  # FLOP/s of a 2048^3 matmul in the dtype in use, the faster GEMM's
    bandwidth: float  # bytes/s streamed from memory, the better of a copy and a reduction


@dataclass(frozen=True)
class Reading:
    """The measurements behind a `Machine`, by source: GEMM FLOP/s ("torch", "native")
    and streaming bytes/s ("copy", "sum"). The machine is the best of each."""

    gemm: dict[str, float]
    stream: dict[str, float]

    @property
    def machine(self) -> Machine:
        return Machine(max(self.gemm.values()), max(self.stream.values()))

    def best_with(self, other: "Reading | None") -> "Reading":
        """Each source's best of this reading and `other`'s (one taken while the shared
        machine was busy would make the roofline too lenient)."""
        if other is None:
            return self

        def best(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            return {k: max(a.get(k, 0.0), b.get(k, 0.0)) for k in a.keys() | b.keys()}

        return Reading(best(self.gemm, other.gemm), best(self.stream, other.stream))

    def as_dict(self) -> dict:
        m = self.machine
        return {
            "gemm_gflops": m.gemm_flops / 1e9,
            "bandwidth_gb_s": m.bandwidth / 1e9,
            "gemm_gflops_by": {k: v / 1e9 for k, v in sorted(self.gemm.items())},
            "stream_gb_s_by": {k: v / 1e9 for k, v in sorted(self.stream.items())},
        }


def roofline_s(cost: StepCost, machine: Machine) -> float:
    return max(cost.bytes / machine.bandwidth, cost.flops / machine.gemm_flops)


def serial_s(cost: StepCost, machine: Machine) -> float:
    """The same step if moving the bytes and computing the FLOPs took turns: what an engine
    whose phases are each bound by one of the two (the linears by the matrix units, decode
    attention by memory) needs at best, one phase after the other, on the same cores."""
    return cost.bytes / machine.bandwidth + cost.flops / machine.gemm_flops


def _best_rate(fn, work: float, repeats: int, budget_s: float = 5.0) -> float:
    """The best of `repeats` timed calls after a warm-up, fewer once `budget_s` is spent
    (the warm-up alone if it took that long): torch's bf16 matmul on a CPU without
    AVX-512 (Zen 3) runs at ~1 GFLOP/s, 15 s a 2048^3 product, far below the peak."""
    start = time.perf_counter()
    fn()
    warm_up = time.perf_counter() - start
    if warm_up > budget_s:
        return work / warm_up
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = max(best, work / (time.perf_counter() - t))
        if time.perf_counter() - start > budget_s:
            break
    return best


def gemm_rates(dtype, size: int = 2048, repeats: int = 6) -> dict[str, float]:
    """Best FLOP/s of `size`^3 products in `dtype`: torch's matmul ("torch") and, where
    this CPU builds it, our own linear kernel ("native", `workers.runner.native.linear`).

    The peak is the faster of the two, so that it bounds what the engine reaches: on an
    AMD Zen 5 torch's fp32 matmul (MKL) ran at ~200 GFLOP/s while our kernel did ~400,
    and a roofline on torch's figure put a 2,048-token fp32 prefill at 153% of "peak"."""
    import torch

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    rates = {"torch": _best_rate(lambda: torch.mm(a, b), 2 * size**3, repeats)}
    kernel = _native_linear_kernel(dtype)
    if kernel is not None:
        packed = kernel.pack(b)
        rates["native"] = _best_rate(lambda: kernel.linear(a, packed, None), 2 * size**3, repeats)
    return rates


def _native_linear_kernel(dtype):
    """Our linear kernel for `dtype`, or None (not built for this CPU, or switched off)."""
    from workers.runner import native

    return native.linear(str(dtype).removeprefix("torch."))


def bandwidth_rates(num_bytes: int = 256 * 2**20, repeats: int = 6) -> dict[str, float]:
    """Best bytes/s of streaming a buffer far larger than the caches: a copy ("copy",
    read + write counted) and a sum ("sum", reads only).

    The bandwidth is the larger: a decode step mostly reads (weights, the KV cache), and a
    copy also pays for reading each destination line before it writes it, so a copy alone
    understates what reads reach (45-66 GB/s summing against ~40 copying, 2 cores of a
    Zen 5)."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return {
        "copy": _best_rate(lambda: dst.copy_(src), 2 * num_bytes, repeats),
        "sum": _best_rate(lambda: src.sum(), num_bytes, repeats),
    }
