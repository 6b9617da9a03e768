"""Quantized linear weights (`EngineConfig.quantization`): how float weights become int8 or
q4, and the linear layer over them.

- int8: symmetric, one fp32 scale per output row (`scale = max |w| / 127`, q in
  [-127, 127]).
- q4: groups of 32 input dims along each row, a scale d and a minimum m per group in
  fp16, 4-bit q in [0, 15]: w = d q + m. GGUF's Q4_1 block (Q4_0 is m = -8 d); made here
  as llama.cpp makes Q4_1 (d = (max - min) / 15, m = min), q rounded against the fp16 d
  and m it will be multiplied by. A Q4_1 GGUF dequantized to float (the default model's
  checkpoint) quantizes back to its own blocks: every block holds a 0 and a 15.

On a CPU our kernel (`workers/runner/native/quant_linear.cpp`) takes the weights in its
tiles and decodes them in its tile loop; the weights stay quantized in memory. Where it
does not run (another CPU, a GPU, `native_kernels` off) or a matrix's shape does not fit
its tiles (rows not a multiple of 64; q4 with input dims not a multiple of 32), the
weight is kept quantized in a plain layout and each call dequantizes it with torch
(`QuantizedWeight.dequantize`): correct, not fast.

The embedding table stays in the model's dtype (a lookup reads a few rows a step); the LM
head is int8 in both modes, as llama.cpp keeps its output matrix at 6-8 bits in a Q4 GGUF:
on the default model it is a fifth of all weights, and its rows decide the next token.
"""

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from workers.engine.config import QUANTIZATIONS
from workers.runner import native

if TYPE_CHECKING:
    from workers.runner.model import ModelWeights

Q4_GROUP = 32
INT8_MAX = 127


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's [out_features, in_features] weight, quantized.

    Plain (`tiled` False): int8 `data` is q [N, K] with `scales` fp32 [N]; q4 `data` is
    the values two to a byte ([N, Kp / 2] uint8, the even dim in the low nibble; Kp is K
    rounded up to 32) with `scales` d and `mins` m, fp16 [N, Kp / 32]. Tiled: `data` is
    the kernel's tiles (`gated`: an MLP gate_up's (gate, up) tile pairs); int8 keeps its
    `scales`, q4's live inside the tiles (`scales` and `mins` None)."""

    kind: str  # "int8" | "q4"
    shape: tuple[int, int]
    data: torch.Tensor
    scales: torch.Tensor | None
    mins: torch.Tensor | None = None
    tiled: bool = False
    gated: bool = False

    def numel(self) -> int:
        """Weights it stands for (as the float matrix's numel)."""
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held: the quantized values and their scales."""
        return sum(t.nbytes for t in (self.data, self.scales, self.mins) if t is not None)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight these values stand for."""
        n, k = self.shape
        if self.tiled:
            return _dequantize_tiles(self)
        if self.kind == "int8":
            assert self.scales is not None
            return self.data.float() * self.scales[:, None]
        assert self.scales is not None and self.mins is not None
        q = unpack_nibbles(self.data).float().view(n, -1, Q4_GROUP)
        w = q * self.scales.float()[..., None] + self.mins.float()[..., None]
        return w.view(n, -1)[:, :k]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scales fp32 [N]): w ~ q * scale, symmetric per row."""
    wf = w.float()
    scales = wf.abs().amax(dim=1) / INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(wf / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def quantize_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, Kp] in 0..15, d fp16 [N, G], m fp16 [N, G]), Kp = K rounded up to 32
    (padded with zeros), G = Kp / 32: w ~ d q + m per group of 32 dims of a row."""
    n, k = w.shape
    pad = -k % Q4_GROUP
    wf = F.pad(w.float(), (0, pad)).view(n, -1, Q4_GROUP)
    lo, hi = torch.aminmax(wf, dim=-1)
    d = hi.sub_(lo).div_(15).to(torch.float16)
    m = lo.to(torch.float16)
    df = d.float()
    inv = torch.where(df > 0, 1 / df, torch.zeros_like(df))  # a constant group: all q 0
    q = wf.sub_(m.float()[..., None]).mul_(inv[..., None]).round_().clamp_(0, 15)
    return q.to(torch.uint8).view(n, -1), d, m


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 (K even) -> [N, K / 2] bytes, the even dim in the low nibble."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`."""
    return torch.stack([b & 15, b >> 4], dim=-1).view(b.shape[0], -1)


def quantize(w: torch.Tensor, kind: str) -> QuantizedWeight:
    """`w` [N, K] quantized in the plain layout, on its own device."""
    shape = (w.shape[0], w.shape[1])
    if kind == "int8":
        q, scales = quantize_int8(w)
        return QuantizedWeight("int8", shape, q, scales)
    if kind == "q4":
        q4, d, m = quantize_q4(w)
        return QuantizedWeight("q4", shape, pack_nibbles(q4), d, m)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS[1:])}, not {kind!r}")


class QuantKernel(Protocol):
    """`workers.runner.native.quant_linear()`: linear layers on quantized tiles."""

    def path(self, dtype: str) -> str: ...
    def pack_int8(self, q: torch.Tensor) -> torch.Tensor: ...
    def pack_int8_gated(self, q: torch.Tensor) -> torch.Tensor: ...
    def pack_q4(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor: ...
    def pack_q4_gated(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor: ...
    def unpack_int8(self, packed: torch.Tensor) -> torch.Tensor: ...
    def unpack_q4(self, packed: torch.Tensor) -> list[torch.Tensor]: ...
    def linear_int8(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...
    def linear_q4(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...
    def linear_silu_int8(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor: ...
    def linear_silu_q4(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor: ...


def fits_tiles(qw: QuantizedWeight, gated: bool = False) -> bool:
    """Whether the kernel's tiles take this matrix (`gated`: as gate and up halves)."""
    n, k = qw.shape
    rows = 128 if gated else 64
    if qw.data.device.type != "cpu" or n % rows:
        return False
    return qw.kind == "int8" or k % Q4_GROUP == 0


def to_tiles(qw: QuantizedWeight, kernel: QuantKernel, gated: bool = False) -> QuantizedWeight:
    """`qw` in the kernel's tiles (`gated`: (gate, up) tile pairs for `linear_silu_*`), or
    as it is where they do not take its shape (`fits_tiles`)."""
    if qw.tiled or not fits_tiles(qw, gated):
        return qw
    if qw.kind == "int8":
        pack = kernel.pack_int8_gated if gated else kernel.pack_int8
        return replace(qw, data=pack(qw.data), tiled=True, gated=gated)
    assert qw.scales is not None and qw.mins is not None
    pack4 = kernel.pack_q4_gated if gated else kernel.pack_q4
    tiles = pack4(unpack_nibbles(qw.data), qw.scales, qw.mins)
    return replace(qw, data=tiles, scales=None, mins=None, tiled=True, gated=gated)


def quantize_tiles(
    w: torch.Tensor, kind: str, kernel: QuantKernel, gated: bool = False
) -> QuantizedWeight:
    """`quantize` then `to_tiles`, without the plain layout in between where the tiles
    take the shape."""
    qw = QuantizedWeight(kind, (w.shape[0], w.shape[1]), w[:0], None)  # the shape alone
    if not fits_tiles(qw, gated):
        return quantize(w, kind)
    if kind == "int8":
        q, scales = quantize_int8(w)
        pack = kernel.pack_int8_gated if gated else kernel.pack_int8
        return replace(qw, data=pack(q), scales=scales, tiled=True, gated=gated)
    q4, d, m = quantize_q4(w)
    pack4 = kernel.pack_q4_gated if gated else kernel.pack_q4
    return replace(qw, data=pack4(q4, d, m), tiled=True, gated=gated)


def quantize_weights(
    weights: "ModelWeights", kind: str, kernel: QuantKernel | None
) -> "ModelWeights":
    """Every linear matrix quantized to `kind` (the LM head to int8), in `kernel`'s tiles
    where it runs and takes the shape; an MLP's gate_up in tile pairs for the fused
    SiLU pass where its halves fit them. Embeddings, norms and biases as they are. A
    matrix that is a QuantizedWeight already (read from a pre-quantized file,
    `quant_files`) only goes into the tiles."""

    def one(w: torch.Tensor, gated: bool = False, as_kind: str = kind) -> QuantizedWeight:
        if isinstance(w, QuantizedWeight):
            if w.kind != as_kind:
                raise ValueError(f"a pre-quantized {w.kind} matrix where {as_kind} is served")
            if kernel is None:
                return w
            qw = to_tiles(w, kernel, gated)
            return to_tiles(w, kernel) if gated and not qw.tiled else qw
        if kernel is None:
            return quantize(w, as_kind)
        qw = quantize_tiles(w, as_kind, kernel, gated)
        return quantize_tiles(w, as_kind, kernel) if gated and not qw.tiled else qw

    layers = [
        replace(
            layer,
            qkv=one(layer.qkv),
            o=one(layer.o),
            gate_up=one(layer.gate_up, gated=True),
            down=one(layer.down),
        )
        for layer in weights.layers
    ]
    return replace(weights, layers=layers, lm_head=one(weights.lm_head, as_kind="int8"))


def quant_kernel(dtype: str) -> QuantKernel | None:
    """Our kernel for activations of `dtype` ("float32" / "bfloat16"), or None: native
    kernels off, no build, or a CPU it has no path for (`path` is "")."""
    module = native.quant_linear()
    return module if module is not None and module.path(dtype) else None


@functools.cache
def _kernel() -> QuantKernel:
    module = native.quant_linear()
    assert module is not None, "a weight in quant_linear's tiles, but no kernel"
    return module


def _dequantize_tiles(qw: QuantizedWeight) -> torch.Tensor:
    kernel = _kernel()
    if qw.kind == "int8":
        assert qw.scales is not None
        return kernel.unpack_int8(qw.data).float() * qw.scales[:, None]
    q, d, m = kernel.unpack_q4(qw.data)
    n, k = qw.shape
    w = q.float().view(n, -1, Q4_GROUP) * d.float()[..., None] + m.float()[..., None]
    return w.view(n, k)


def quantized_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T + b: in our kernel for tiles, else W dequantized by torch for this call."""
    if qw.tiled and not qw.gated:
        if qw.kind == "int8":
            assert qw.scales is not None
            return _kernel().linear_int8(x, qw.data, qw.scales, bias)
        return _kernel().linear_q4(x, qw.data, bias)
    return F.linear(x, qw.dequantize().to(x.dtype), bias)


def quantized_mlp_up(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor | None:
    """silu(x W_gate^T) * (x W_up^T) in one pass for a gate_up in tile pairs; None for any
    other (the caller runs the linear, then its SiLU)."""
    if not qw.gated:
        return None
    if qw.kind == "int8":
        assert qw.scales is not None
        return _kernel().linear_silu_int8(x, qw.data, qw.scales)
    return _kernel().linear_silu_q4(x, qw.data)


def weight_bytes(weights: "ModelWeights") -> int:
    """Bytes of the linear matrices as held (quantized, packed or dense), the LM head
    counted apart from a tied embedding: what a decode step reads of the weights."""

    def held(m: "torch.Tensor | QuantizedWeight") -> int:
        if isinstance(m, torch.Tensor) and m.is_mkldnn:  # oneDNN's layout has no nbytes
            return m.numel() * m.element_size()
        return m.nbytes

    return sum(held(m) for m in weights.linears())
