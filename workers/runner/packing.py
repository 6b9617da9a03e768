"""The linear layers and their weights: packed once at load into oneDNN's blocked layout
or our native kernel's tiles (`pack_weights`), and the linear functions the forward pass
calls on them (`packed_linear`, `dense_linear`, `gated_mlp_up`), which also take
quantized weights (`workers.runner.quant.QuantizedWeight`).
"""

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from workers.runner import native
from workers.runner.memory import HugeArena
from workers.runner.ops import TorchOps
from workers.runner.quant import QuantizedWeight, quantized_linear, quantized_mlp_up

if TYPE_CHECKING:  # model.py imports this module for its linear functions
    from workers.runner.model import ModelWeights


Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the linear weights can be reordered once for oneDNN (CPU, fp32/bf16; bf16
    only where oneDNN runs it: AVX-512 or AVX-NE-CONVERT, not an AVX2 CPU such as Zen 3,
    where its reorder raises)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def map_linears(
    weights: "ModelWeights",
    fn: Callable[[torch.Tensor], torch.Tensor],
    gate_up_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> "ModelWeights":
    """The same weights with `fn` applied to every linear matrix (qkv, o, gate_up, down,
    the LM head), gate_up through `gate_up_fn` if given; embeddings, norms and biases as
    they are."""
    gate_up_fn = gate_up_fn or fn
    layers = [
        replace(
            layer,
            qkv=fn(layer.qkv),
            o=fn(layer.o),
            gate_up=gate_up_fn(layer.gate_up),
            down=fn(layer.down),
        )
        for layer in weights.layers
    ]
    return replace(weights, layers=layers, lm_head=fn(weights.lm_head))


def pack_weights(
    weights: "ModelWeights", kernel: "NativeLinear | None" = None, onednn: bool = True
) -> "ModelWeights":
    """The same weights with every linear matrix reordered once, for `packed_linear`;
    embeddings and norms stay dense.

    With `kernel` (`workers.runner.native.linear`, a CPU with AVX-512, bf16 also AVX512-BF16, or
    with AVX2):
    into its tiles of 64 columns, where the matrix has a multiple of 64 rows. Measured
    by `switchyard bench engine --scenarios levers` against the same weights in oneDNN's
    layout (docs/benchmarks/engine-roofline.md).

    An MLP's gate_up goes into pairs of tiles, gate beside up (`pack_gated`), so that
    `gated_mlp_up` applies SiLU and the product in the GEMM's epilogue: no [tokens,
    2 x intermediate] output written and read back (bf16, bench model, a layer: batch 64
    0.59 -> 0.47 ms, 2,048 tokens 17.8 -> 15.1 ms; the same bits as the two-pass path).

    Otherwise into oneDNN's blocked layout, or with `onednn` False (`can_pack` says no:
    bf16 on an AVX2 CPU) left dense for `F.linear`. Dense weights are re-blocked by the GEMM
    inside every call; decode steps are small enough that this shows: dense weights made
    decode steps 1.4-3.3x slower at batch 1-64 in fp32, 1.3-2.2x in bf16, than our
    tiles (the same report). Either packing
    rounds fp32 differently from `F.linear` (another order of the sums than MKL's).
    """

    def pack(w: torch.Tensor) -> torch.Tensor:
        if isinstance(w, QuantizedWeight):  # already in the quantized kernel's tiles
            return w
        if kernel is not None and w.shape[0] % 64 == 0 and w.shape[1] % 2 == 0:
            return kernel.pack(w)
        return torch.ops.mkldnn._reorder_linear_weight(w) if onednn else w

    def pack_gate_up(w: torch.Tensor) -> torch.Tensor:
        if isinstance(w, QuantizedWeight):
            return w
        if kernel is not None and w.shape[0] % 128 == 0 and w.shape[1] % 2 == 0:
            return kernel.pack_gated(w)
        return pack(w)

    return map_linears(weights, pack, pack_gate_up)


def on_huge_pages(weights: "ModelWeights") -> "ModelWeights":
    """The linear weights our kernels stream every step (all but oneDNN's, and a quantized
    weight's every tensor) copied into one `HugeArena` (`workers.runner.memory`)."""

    def tensors(w) -> list[torch.Tensor]:
        if isinstance(w, QuantizedWeight):
            return [t for t in (w.data, w.scales, w.mins) if t is not None]
        return [] if w.is_mkldnn else [w]

    arena = HugeArena([t for w in weights.linears() for t in tensors(w)])

    def copy(w):
        if isinstance(w, QuantizedWeight):
            return replace(
                w,
                data=arena.copy(w.data),
                scales=None if w.scales is None else arena.copy(w.scales),
                mins=None if w.mins is None else arena.copy(w.mins),
            )
        return w if w.is_mkldnn else arena.copy(w)

    return map_linears(weights, copy)


class NativeLinear(Protocol):
    """`workers.runner.native.linear()`: linear layers on weights in its own tiles."""

    def pack(self, w: torch.Tensor) -> torch.Tensor: ...

    def pack_gated(self, w: torch.Tensor) -> torch.Tensor: ...

    def unpack(self, packed: torch.Tensor) -> torch.Tensor: ...

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def linear_silu(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor: ...


@functools.cache
def _native_linear(dtype: torch.dtype) -> NativeLinear:
    module = native.linear(str(dtype).removeprefix("torch."))
    assert module is not None, "a weight in workers.runner.native.linear's tiles, but no kernel"
    return module


def packed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for a weight from `pack_weights`: oneDNN's layout, our tiles, or dense
    (where neither takes it); or quantized."""
    if isinstance(w, QuantizedWeight):
        return quantized_linear(x, w, bias)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if w.dim() == 2:
        return F.linear(x, w, bias)
    return _native_linear(w.dtype).linear(x, w, bias)


def gated_mlp_up(
    x: torch.Tensor, gate_up: torch.Tensor, linear: Linear, ops: TorchOps
) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T): in one pass of our kernel for a gate_up in its tile
    pairs (`pack_weights`; 5-D, or quantized tile pairs), else the linear and then
    `ops.silu_mul`."""
    if isinstance(gate_up, QuantizedWeight):
        fused = quantized_mlp_up(x, gate_up)
        return ops.silu_mul(linear(x, gate_up, None)) if fused is None else fused
    if gate_up.dim() == 5:
        return _native_linear(gate_up.dtype).linear_silu(x, gate_up)
    return ops.silu_mul(linear(x, gate_up, None))


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(w, QuantizedWeight):
        return quantized_linear(x, w, bias)
    return F.linear(x, w, bias)
