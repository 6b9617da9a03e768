"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one flat-batch forward pass.

Every token of a step (decodes and prefill chunks of many sequences) goes through the
linear layers as one matrix; only attention looks at sequence boundaries. Numerics follow
transformers' modeling code (RMSNorm in fp32, rotate-half RoPE) so greedy output matches.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from workers.attention import AttentionMetadata, paged_attention, write_kv
from workers.model_config import ModelConfig


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

    def num_parameters(self) -> int:
        tensors = [self.embed, self.norm]
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(t.numel() for t in tensors)


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

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        return self.apply(q, k, *self.lookup(positions))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ([tokens, 1, dim]) of a step's positions: once per step, not layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
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


class CausalLM:
    """Forward pass over a flat batch with a paged KV cache.

    With `tp` (a shard group), `cfg` is this rank's share (`workers.tp.plan.local_config`)
    and `weights` its shard; None is one device, unchanged.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        max_positions: int,
        tp: ShardOps | None = None,
    ) -> None:
        self.cfg = cfg
        self.weights = weights
        self.tp = tp
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
        cfg, w, tp = self.cfg, self.weights, self.tp
        eps = cfg.rms_norm_eps
        n = input_ids.shape[0]
        h = F.embedding(input_ids, w.embed) if tp is None else tp.embed(input_ids, w.embed)
        cos, sin = self.rotary.lookup(positions)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(w.layers, kv_caches, strict=True)):
            x = rms_norm(h, layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(n, cfg.num_heads, cfg.head_dim)
            k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, eps)
                k = rms_norm(k, layer.k_norm, eps)
            q, k = self.rotary.apply(q, k, cos, sin)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, i, k_cache, v_cache, meta, block_size, self.scale)
            o = F.linear(attn, layer.o)
            h = h + (o if tp is None else tp.all_reduce(o))
            x = rms_norm(h, layer.post_norm, eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            down = F.linear(F.silu(gate) * up, layer.down)
            h = h + (down if tp is None else tp.all_reduce(down))
        h = rms_norm(h[logits_indices], w.norm, eps)
        logits = F.linear(h, w.lm_head).float()
        return logits if tp is None else tp.gather_logits(logits)
