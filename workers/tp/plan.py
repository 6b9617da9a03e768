"""What one rank of a shard group holds. Pure arithmetic over the model's shape."""

from dataclasses import dataclass, replace

from workers.errors import CheckpointError
from workers.models.model_config import ModelConfig


class ShardingError(CheckpointError):
    """The model cannot be split over this many ranks (heads or columns not divisible)."""


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raise ShardingError naming every dimension that does not split into `size` parts."""
    if size < 1:
        raise ShardingError(f"tensor_parallel must be at least 1, got {size}")
    dims = {
        "attention heads (num_attention_heads)": cfg.num_heads,
        "KV heads (num_key_value_heads)": cfg.num_kv_heads,
        "MLP columns (intermediate_size)": cfg.intermediate_size,
    }
    bad = [f"{n} {name}" for name, n in dims.items() if n % size]
    if bad:
        raise ShardingError(
            f"cannot shard this model over tensor_parallel={size}: {', '.join(bad)} "
            f"{'is' if len(bad) == 1 else 'are'} not divisible by {size}; choose a "
            f"tensor_parallel that divides {cfg.num_kv_heads} (the KV heads), "
            f"{cfg.num_heads} and {cfg.intermediate_size}"
        )


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`: its slice of every sharded dimension (start, stop)."""

    rank: int
    size: int
    q_rows: tuple[int, int]  # rows of q_proj (its query heads x head_dim)
    kv_rows: tuple[int, int]  # rows of k_proj / v_proj (its KV heads x head_dim)
    mlp_rows: tuple[int, int]  # rows of gate_proj / up_proj, columns of down_proj
    vocab_rows: tuple[int, int]  # rows of embed / lm_head held (the last rank may hold fewer)
    vocab_per_rank: int  # ceil(vocab / size): every rank's padded vocabulary shard


def _part(total: int, rank: int, size: int) -> tuple[int, int]:
    per = total // size
    return rank * per, (rank + 1) * per


def make_plan(cfg: ModelConfig, rank: int, size: int) -> ShardPlan:
    check_shardable(cfg, size)
    hd = cfg.head_dim
    q0, q1 = _part(cfg.num_heads, rank, size)
    k0, k1 = _part(cfg.num_kv_heads, rank, size)
    per_vocab = -(-cfg.vocab_size // size)
    v0 = min(rank * per_vocab, cfg.vocab_size)
    return ShardPlan(
        rank=rank,
        size=size,
        q_rows=(q0 * hd, q1 * hd),
        kv_rows=(k0 * hd, k1 * hd),
        mlp_rows=_part(cfg.intermediate_size, rank, size),
        vocab_rows=(v0, min(v0 + per_vocab, cfg.vocab_size)),
        vocab_per_rank=per_vocab,
    )


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The model as one rank sees it: its share of heads and MLP columns. The vocabulary
    stays whole (requests are checked against it; logits are gathered whole on rank 0)."""
    check_shardable(cfg, size)
    return replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
    )
