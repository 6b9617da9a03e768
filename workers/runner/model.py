"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one flat-batch forward pass.

Every token of a step (decodes and prefill chunks of many sequences) goes through the
linear layers as one matrix; only attention looks at sequence boundaries. Numerics follow
transformers' modeling code (RMSNorm in fp32, rotate-half RoPE) so greedy output matches.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from workers.models.model_config import ModelConfig
from workers.runner import native
from workers.runner.attention import AttentionMetadata, paged_attention, write_kv
from workers.runner.sampler import argmax_rows


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q + k + v, hidden], fused
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3 per-head RMSNorm
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden], fused
    down: torch.Tensor


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor

    def linears(self) -> list[torch.Tensor]:
        """The linear matrices `map_linears` maps, in its order."""
        mats = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return mats + [self.lm_head]

    def num_parameters(self) -> int:
        tensors = [self.embed, self.norm]
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(t.numel() for t in tensors)


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
    weights: ModelWeights,
    fn: Callable[[torch.Tensor], torch.Tensor],
    gate_up_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> ModelWeights:
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
    return ModelWeights(weights.embed, layers, weights.norm, fn(weights.lm_head))


def pack_weights(
    weights: ModelWeights, kernel: "NativeLinear | None" = None, onednn: bool = True
) -> ModelWeights:
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
        if kernel is not None and w.shape[0] % 64 == 0 and w.shape[1] % 2 == 0:
            return kernel.pack(w)
        return torch.ops.mkldnn._reorder_linear_weight(w) if onednn else w

    def pack_gate_up(w: torch.Tensor) -> torch.Tensor:
        if kernel is not None and w.shape[0] % 128 == 0 and w.shape[1] % 2 == 0:
            return kernel.pack_gated(w)
        return pack(w)

    return map_linears(weights, pack, pack_gate_up)


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
    (where neither takes it)."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if w.dim() == 2:
        return F.linear(x, w, bias)
    return _native_linear(w.dtype).linear(x, w, bias)


def gated_mlp_up(
    x: torch.Tensor, gate_up: torch.Tensor, linear: Linear, ops: "TorchOps"
) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T): in one pass of our kernel for a gate_up in its tile
    pairs (`pack_weights`; 5-D), else the linear and then `ops.silu_mul`."""
    if gate_up.dim() == 5:
        return _native_linear(gate_up.dtype).linear_silu(x, gate_up)
    return ops.silu_mul(linear(x, gate_up, None))


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_inv_freq(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """Inverse rotary frequencies, computed as transformers computes them (fp32)."""
    dim = cfg.head_dim
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    inv = 1.0 / (cfg.rope_theta**exps)
    scaling = cfg.rope_scaling
    if not scaling:
        return inv
    factor = float(scaling["factor"])
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        return inv / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * torch.pi / inv
    inv_llama = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, inv_llama)


class RotaryEmbedding:
    """cos/sin tables for every position, looked up per token."""

    def __init__(
        self, cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype
    ):
        inv = rope_inv_freq(cfg, device)
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ([tokens, dim]) of a step's positions: once per step, not layer."""
        return self.cos[positions], self.sin[positions]

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [tokens, heads, dim] and k [tokens, kv_heads, dim] rotated by `lookup`'s."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ShardOps(Protocol):
    """The collectives of a shard group (`workers.tp`) that the forward pass calls."""

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Hidden states from a vocabulary-sharded embedding (summed over the ranks)."""
        ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial outputs of a row-parallel layer."""
        ...

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary logits from each rank's vocabulary shard."""
        ...


class FusedOps(Protocol):
    """`workers.runner.native.fused_ops()`: the per-layer small ops, one pass each, the paged
    cache's write and the greedy argmax."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm_(
        self, h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor: ...

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
    ) -> None: ...

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor: ...


class TorchOps:
    """The per-layer small ops in torch (any device): the reference for `NativeOps`."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor):
        """(h + delta, its RMSNorm): the residual stream and the next sublayer's input."""
        h = h + delta
        return h, rms_norm(h, weight, self.eps)

    def rope(self, q, k, cos, sin):
        return RotaryEmbedding.apply(q, k, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def write_kv(self, k_cache, v_cache, k, v, slots) -> None:
        write_kv(k_cache, v_cache, k, v, slots)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        return argmax_rows(logits)


class NativeOps(TorchOps):
    """The same ops, each one pass of our C++ (`workers/runner/native/fused_ops.cpp`): a decode
    step runs ~30 small torch ops per layer otherwise. Same roundings as torch; fp32 may
    differ in the last bit of a sum (RMSNorm) or of exp (SiLU)."""

    def __init__(self, fused: FusedOps, cfg: ModelConfig) -> None:
        super().__init__(cfg.rms_norm_eps)
        self.fused = fused

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.fused.rms_norm(x, weight, self.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor):
        return h, self.fused.add_rms_norm_(h, delta, weight, self.eps)  # h updated in place

    def rope(self, q, k, cos, sin):
        return self.fused.rope(q, k, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.fused.silu_mul(gate_up)

    def write_kv(self, k_cache, v_cache, k, v, slots) -> None:
        self.fused.write_kv(k_cache, v_cache, k, v, slots)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        return self.fused.argmax_rows(logits)


class CausalLM:
    """Forward pass over a flat batch with a paged KV cache.

    With `tp` (a shard group), `cfg` is this rank's share (`workers.tp.plan.local_config`)
    and `weights` its shard; None is one device, unchanged. `fused`: the native fused
    per-layer ops (`workers.runner.native.fused_ops`) on the CPU; None = torch's ops. `packed`:
    the linear weights went through `pack_weights`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        max_positions: int,
        tp: ShardOps | None = None,
        fused: FusedOps | None = None,
        packed: bool = False,
    ) -> None:
        self.cfg = cfg
        self.linear: Linear = packed_linear if packed else dense_linear
        self.weights = weights
        self.tp = tp
        self.ops = TorchOps(cfg.rms_norm_eps) if fused is None else NativeOps(fused, cfg)
        device, dtype = weights.embed.device, weights.embed.dtype
        self.rotary = RotaryEmbedding(cfg, max_positions, device, dtype)
        self.scale = cfg.head_dim**-0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ([len(logits_indices), vocab], fp32) of the rows that sample a token."""
        cfg, w, tp, ops, linear = self.cfg, self.weights, self.tp, self.ops, self.linear
        eps = cfg.rms_norm_eps
        n = input_ids.shape[0]
        h = F.embedding(input_ids, w.embed) if tp is None else tp.embed(input_ids, w.embed)
        cos, sin = self.rotary.lookup(positions)
        x = ops.norm(h, w.layers[0].input_norm)
        last = len(w.layers) - 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(w.layers, kv_caches, strict=True)):
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(n, cfg.num_heads, cfg.head_dim)
            k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, eps)
                k = rms_norm(k, layer.k_norm, eps)
            q, k = ops.rope(q, k, cos, sin)
            ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, i, k_cache, v_cache, meta, block_size, self.scale)
            o = linear(attn, layer.o, None)
            h, x = ops.add_norm(h, o if tp is None else tp.all_reduce(o), layer.post_norm)
            down = linear(gated_mlp_up(x, layer.gate_up, linear, ops), layer.down, None)
            down = down if tp is None else tp.all_reduce(down)
            if i < last:
                h, x = ops.add_norm(h, down, w.layers[i + 1].input_norm)
            else:
                h = h + down
        h = ops.norm(h[logits_indices], w.norm)
        logits = linear(h, w.lm_head, None).float()
        return logits if tp is None else tp.gather_logits(logits)
