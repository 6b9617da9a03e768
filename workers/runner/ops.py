"""The per-layer small ops of the forward pass: RMSNorm, rotary embeddings, the paged
cache's write and the greedy argmax, in torch (`TorchOps`, any device) or one pass each of
our C++ (`NativeOps`); and the protocols of what the forward pass calls on a shard group
(`ShardOps`) and on the native fused ops (`FusedOps`).
"""

from typing import Protocol

import torch
import torch.nn.functional as F

from workers.models.model_config import ModelConfig
from workers.runner.attention import write_kv
from workers.runner.kv_int8 import Int8KV
from workers.runner.sampler import argmax_rows


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
        if isinstance(k_cache, Int8KV):  # an int8 cache writes through its own kernels
            write_kv(k_cache, v_cache, k, v, slots)
            return
        self.fused.write_kv(k_cache, v_cache, k, v, slots)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        return self.fused.argmax_rows(logits)
