"""Shard plans: what each rank holds, and the shapes that cannot be split."""

import pytest

from workers.models.model_config import ModelConfig
from workers.tp.plan import ShardingError, check_shardable, local_config, make_plan


def model(heads=8, kv_heads=4, inter=1408, vocab=8193, head_dim=64) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=heads * head_dim,
        intermediate_size=inter,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
        rope_theta=10000.0,
        rope_scaling=None,
        sliding_window=None,
        eos_token_ids=(2,),
        bos_token_id=1,
    )


def test_each_rank_holds_its_heads_columns_and_a_padded_vocabulary_slice():
    cfg = model()
    plans = [make_plan(cfg, r, 2) for r in range(2)]
    assert [p.q_rows for p in plans] == [(0, 256), (256, 512)]
    assert [p.kv_rows for p in plans] == [(0, 128), (128, 256)]
    assert [p.mlp_rows for p in plans] == [(0, 704), (704, 1408)]
    # 8193 tokens over 2 ranks: 4097 each, the last rank's shard padded by one row.
    assert [p.vocab_rows for p in plans] == [(0, 4097), (4097, 8193)]
    assert plans[1].vocab_per_rank == 4097


def test_the_local_config_keeps_the_vocabulary_and_splits_heads_and_columns():
    local = local_config(model(), 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 352)
    assert local.vocab_size == 8193 and local.head_dim == 64


@pytest.mark.parametrize(
    "kw, size, named",
    [
        (dict(heads=6, kv_heads=2), 4, "6 attention heads"),
        (dict(heads=8, kv_heads=2), 4, "2 KV heads"),
        (dict(inter=1410), 4, "1410 MLP columns"),
    ],
)
def test_shapes_that_do_not_divide_are_refused_naming_the_dimension(kw, size, named):
    with pytest.raises(ShardingError, match=named) as err:
        check_shardable(model(**kw), size)
    assert f"tensor_parallel={size}" in str(err.value)


def test_one_rank_always_shards():
    check_shardable(model(heads=7, kv_heads=7, inter=999), 1)
