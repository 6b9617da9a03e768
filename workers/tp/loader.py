"""Load one rank's shard of a checkpoint: only its slices are read from the safetensors.

Each rank reads `get_slice(...)[rows]`, never a whole tensor it does not hold, so a model
too large for one device (or one process's memory) is never materialised in one place.
"""

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from workers.errors import CheckpointError
from workers.models.model_config import ModelConfig
from workers.runner.loader import safetensors_files
from workers.runner.model import LayerWeights, ModelWeights
from workers.tp.plan import ShardPlan


class _Slicer:
    """Tensors by name across the shard files, read a slice at a time."""

    def __init__(self, model_dir: Path, stack: ExitStack) -> None:
        self.model_dir = model_dir
        self.where = {}
        for path in safetensors_files(model_dir):
            f = stack.enter_context(safe_open(str(path), framework="pt"))
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self.where[name] = f

    def has(self, name: str) -> bool:
        return name in self.where

    def take(
        self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None, dim: int = 0
    ) -> torch.Tensor:
        """`name` checked against its full `shape`; `rows` = (start, stop) along `dim`."""
        f = self.where.get(name)
        if f is None:
            raise CheckpointError(
                f"{self.model_dir}: tensor {name!r} is missing (expected shape {shape})"
            )
        sl = f.get_slice(name)
        if tuple(sl.get_shape()) != shape:
            raise CheckpointError(
                f"{self.model_dir}: tensor {name!r} has shape {tuple(sl.get_shape())}, "
                f"expected {shape}"
            )
        if rows is None:
            return sl[:]
        if dim == 0:
            return sl[rows[0] : rows[1]]
        return sl[:, rows[0] : rows[1]]


def _vocab_shard(t: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """Pad the last rank's shard with zero rows so every rank holds `vocab_per_rank`."""
    missing = plan.vocab_per_rank - t.shape[0]
    if missing:
        t = torch.cat([t, t.new_zeros(missing, *t.shape[1:])])
    return t


def load_shard(
    cfg: ModelConfig, plan: ShardPlan, model_dir: Path, dtype: torch.dtype, device: torch.device
) -> ModelWeights:
    """This rank's weights: fused qkv and gate/up of its heads and columns, o and down's
    matching columns, its vocabulary rows of embed and lm_head; norms whole."""
    hidden, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_size, kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
    with ExitStack() as stack:
        src = _Slicer(model_dir, stack)

        def take(name, shape, rows=None, dim=0) -> torch.Tensor:
            return src.take(name, shape, rows, dim).to(device=device, dtype=dtype).contiguous()

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat(
                [
                    take(a + "q_proj.weight", (q_size, hidden), plan.q_rows),
                    take(a + "k_proj.weight", (kv_size, hidden), plan.kv_rows),
                    take(a + "v_proj.weight", (kv_size, hidden), plan.kv_rows),
                ]
            )
            bias = None
            if cfg.qkv_bias:
                bias = torch.cat(
                    [
                        take(a + "q_proj.bias", (q_size,), plan.q_rows),
                        take(a + "k_proj.bias", (kv_size,), plan.kv_rows),
                        take(a + "v_proj.bias", (kv_size,), plan.kv_rows),
                    ]
                )
            gate_up = torch.cat(
                [
                    take(p + "mlp.gate_proj.weight", (inter, hidden), plan.mlp_rows),
                    take(p + "mlp.up_proj.weight", (inter, hidden), plan.mlp_rows),
                ]
            )
            layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight", (hidden,)),
                    qkv=qkv,
                    qkv_bias=bias,
                    q_norm=take(a + "q_norm.weight", (hd,)) if cfg.qk_norm else None,
                    k_norm=take(a + "k_norm.weight", (hd,)) if cfg.qk_norm else None,
                    o=take(a + "o_proj.weight", (hidden, q_size), plan.q_rows, dim=1),
                    post_norm=take(p + "post_attention_layernorm.weight", (hidden,)),
                    gate_up=gate_up,
                    down=take(p + "mlp.down_proj.weight", (hidden, inter), plan.mlp_rows, dim=1),
                )
            )
        vocab = (cfg.vocab_size, hidden)
        embed = _vocab_shard(take("model.embed_tokens.weight", vocab, plan.vocab_rows), plan)
        if cfg.tie_word_embeddings or not src.has("lm_head.weight"):
            if not cfg.tie_word_embeddings:
                raise CheckpointError(f"{model_dir}: tensor 'lm_head.weight' is missing")
            lm_head = embed
        else:
            lm_head = _vocab_shard(take("lm_head.weight", vocab, plan.vocab_rows), plan)
        norm = take("model.norm.weight", (hidden,))
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
