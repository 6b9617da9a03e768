"""The int8 KV cache in torch (`workers.runner.kv_int8`) and the planner's numbers for it:
the same `kv_cache_gib` holds at least 1.9x the tokens of a bf16 cache."""

import dataclasses

import pytest
import torch

from workers.engine.config import EngineConfig
from workers.models.model_config import ModelConfig
from workers.runner.decode_workspace import DecodeWorkspace
from workers.runner.kv_int8 import Int8KV, dequantize, quantize, write_kv
from workers.runner.plan import kv_bytes_per_token, plan_num_kv_blocks, plan_workspace_rows

GIB = 2**30
CPU = torch.device("cpu")

SMOLLM2 = ModelConfig(  # the default real model's shape: 30 layers, 3 KV heads of 64
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    qkv_bias=False,
    qk_norm=False,
    rope_theta=1e5,
    rope_scaling=None,
    sliding_window=None,
    eos_token_ids=(2,),
    bos_token_id=1,
)
LLAMA_8B = dataclasses.replace(SMOLLM2, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)


def test_an_int8_token_is_one_byte_a_number_and_a_bf16_scale_a_head():
    assert kv_bytes_per_token(SMOLLM2, torch.bfloat16) == 2 * 30 * 3 * 64 * 2  # 23,040
    assert kv_bytes_per_token(SMOLLM2, torch.bfloat16, "int8") == 2 * 30 * 3 * (64 + 2)
    assert kv_bytes_per_token(SMOLLM2, torch.float32, "int8") == 2 * 30 * 3 * (64 + 2)
    assert kv_bytes_per_token(LLAMA_8B, torch.bfloat16, "int8") == 2 * 32 * 8 * (128 + 2)


@pytest.mark.parametrize("cfg", [SMOLLM2, LLAMA_8B], ids=["head64", "head128"])
@pytest.mark.parametrize("gib", [0.375, 0.5, 4.0])
def test_the_same_kv_cache_gib_holds_at_least_1_9x_the_tokens_of_bf16(cfg, gib):
    budget = int(gib * GIB)

    def tokens(kv_cache_dtype: str) -> int:
        per = kv_bytes_per_token(cfg, torch.bfloat16, kv_cache_dtype)
        return 16 * plan_num_kv_blocks(64 * GIB, 0.9, per, 16, 10**9, budget_bytes=budget)

    bf16, int8 = tokens("auto"), tokens("int8")
    assert int8 >= 1.9 * bf16
    assert int8 * kv_bytes_per_token(cfg, torch.bfloat16, "int8") <= budget
    # the decode workspace's rows are int8 too: 1.9x the rows in its budget, but for the
    # part-row each count rounds off
    per8, per16 = (kv_bytes_per_token(cfg, torch.bfloat16, d) for d in ("int8", "auto"))
    rows8, rows16 = (plan_workspace_rows(budget, per, 512, 10**6) for per in (per8, per16))
    assert rows8 + 1 >= 1.9 * rows16


def test_kv_cache_dtype_is_auto_or_int8():
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        EngineConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_write_stores_rows_and_hands_k_and_v_back_as_stored(dtype):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(5, 2, 64, generator=gen).to(dtype)
    v = torch.randn(5, 2, 64, generator=gen).to(dtype)
    k0 = k.clone()
    caches = [Int8KV.zeros((2, 16, 64), dtype, CPU, None) for _ in range(2)]
    slots = torch.tensor([3, 9, 0, 15, 4])
    write_kv(caches[0], caches[1], k, v, slots)
    q, s = quantize(k0)
    assert torch.equal(caches[0].data[:, slots], q.transpose(0, 1))
    assert torch.equal(caches[0].scale[:, slots], s.transpose(0, 1))
    assert torch.equal(k, dequantize(q, s, dtype))
    # blocks() reads back whole blocks in table order, dequantized
    got = caches[0].blocks(torch.tensor([2, 0]), 4)  # slots 8..11 then 0..3
    assert torch.equal(got[:, 1], k.transpose(0, 1)[:, 1])  # slot 9
    assert torch.equal(got[:, 4], k.transpose(0, 1)[:, 2])  # slot 0
    assert caches[0].nbytes == 2 * 16 * 64 + 2 * 16 * 2


def test_an_int8_workspace_holds_the_caches_bytes_and_moves_rows_whole():
    """Rows are filled from the paged cache, appended from it and compacted when a
    sequence leaves: data and scales alike, with no re-quantization."""
    gen = torch.Generator().manual_seed(1)
    heads, dim, block = 2, 64, 4
    cache = []
    for _ in range(2):
        q, s = quantize(torch.randn(heads, 10 * block, dim, generator=gen))
        cache.append(Int8KV(q, s, torch.float32))
    ws = DecodeWorkspace(1, heads, dim, 3, 16, torch.float32, CPU, int8=True)
    assert ws.nbytes() == 2 * heads * 3 * 16 * (dim + 2)
    tables = [[3, 1], [7], [0, 2, 5]]
    order = ws.prepare(["a", "b", "c"], [6, 3, 9], tables, [tuple(cache)], block)
    assert order == [0, 1, 2]

    def slots_of(table, n):
        return [
            b * block + i % block for i, b in enumerate(t for t in table for _ in range(block))
        ][:n]

    for row, (table, n) in enumerate(zip(tables, [6, 3, 9], strict=True)):
        slots = torch.tensor(slots_of(table, n))
        assert torch.equal(ws.k[0].data[:, row, :n], cache[0].data[:, slots])
        assert torch.equal(ws.v[0].scale[:, row, :n], cache[1].scale[:, slots])
    # append each row's next token from cache slots, as the torch decode path does
    new = torch.tensor([20, 21, 22])
    ws.append(0, cache[0].rows(new), cache[1].rows(new), ws.slots(torch.tensor([6, 3, 9])))
    ws.commit(["a", "b", "c"])
    assert torch.equal(ws.k[0].data[:, 1, 3], cache[0].data[:, 21])
    keys, _ = ws.view(0, 3, 10)
    assert torch.equal(
        keys[:, 2, 9], dequantize(cache[0].data[:, 22], cache[0].scale[:, 22], torch.float32)
    )
    # "a" leaves: "c" (the last row) moves into row 0 with its scales
    before = ws.k[0].scale[:, 2, :10].clone()
    assert ws.prepare(["b", "c"], [4, 10], [tables[1], tables[2]], [tuple(cache)], block) == [1, 0]
    assert torch.equal(ws.k[0].scale[:, 0, :10], before)
