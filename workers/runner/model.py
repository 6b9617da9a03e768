"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one flat-batch forward pass.

Every token of a step (decodes and prefill chunks of many sequences) goes through the
linear layers as one matrix; only attention looks at sequence boundaries. Numerics follow
transformers' modeling code (RMSNorm in fp32, rotate-half RoPE) so greedy output matches.
The per-layer small ops are in `ops`, the linear layers and their weights' packing in
`packing`.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.models.model_config import ModelConfig
from workers.runner.attention import AttentionMetadata, paged_attention
from workers.runner.ops import FusedOps, NativeOps, RotaryEmbedding, ShardOps, TorchOps, rms_norm
from workers.runner.packing import Linear, dense_linear, gated_mlp_up, packed_linear


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
        """The linear matrices `packing.map_linears` maps, in its order."""
        mats = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return mats + [self.lm_head]

    def num_parameters(self, tied: bool | None = None) -> int:
        """`tied`: the LM head is the embedding table (held apart when quantized, or kept
        in the checkpoint's dtype to be); None: when the two share memory."""
        if tied is None:
            tied = self.lm_head.data_ptr() == self.embed.data_ptr()
        tensors = [self.embed, self.norm]
        if not tied:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(t.numel() for t in tensors)


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
