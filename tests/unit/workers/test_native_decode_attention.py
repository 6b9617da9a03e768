"""The native workspace decode-attention kernel against a float64 reference.

It must be built on this machine (the test fails, not skips, if it is not: the engine
would silently run the slower torch path everywhere)."""

import pytest
import torch

from workers.runner import native


@pytest.fixture(scope="module")
def kernel():
    k = native.decode_attention()
    assert k is not None, "the native kernel did not build (see the log)"
    return k


def reference(q, k_ws, v_ws, lengths, scale):
    """Attention of each row's query over its first `lengths[s]` workspace tokens."""
    seqs, heads, dim = q.shape
    group = heads // k_ws.shape[0]
    out = torch.empty(seqs, heads, dim, dtype=torch.float64)
    for s in range(seqs):
        n = int(lengths[s])
        for h in range(heads):
            keys = k_ws[h // group, s, :n].double()
            values = v_ws[h // group, s, :n].double()
            p = torch.softmax(keys @ q[s, h].double() * scale, dim=0)
            out[s, h] = p @ values
    return out


def make_case(seqs, heads, kv_heads, dim, rows, tokens, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k_ws = torch.randn(kv_heads, rows, tokens, dim, generator=gen).to(dtype)
    v_ws = torch.randn(kv_heads, rows, tokens, dim, generator=gen).to(dtype)
    # q and a strided v_new, as the model produces them (v is a slice of the fused qkv).
    q = torch.randn(seqs, heads, dim, generator=gen).to(dtype)
    k_new = torch.randn(seqs, kv_heads, dim, generator=gen).to(dtype)
    qkv_v = torch.randn(seqs, 3 * kv_heads * dim, generator=gen).to(dtype)
    v_new = qkv_v[:, kv_heads * dim : 2 * kv_heads * dim].view(seqs, kv_heads, dim)
    lengths = torch.randint(1, tokens + 1, (seqs,), generator=gen)
    lengths[0] = 1  # a sequence whose only key is this step's
    lengths[-1] = tokens  # and one that fills its row
    return q, k_new, v_new, k_ws, v_ws, lengths


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    # query heads per KV head: 1, 4, 2, 4, and more than one pass over the values (6, 5)
    [(4, 4, 64), (8, 2, 64), (6, 3, 128), (4, 1, 32), (12, 2, 64), (10, 2, 128)],
)
def test_matches_reference_and_appends_the_new_token(kernel, dtype, tol, heads, kv_heads, dim):
    seqs, rows, tokens = 5, 7, 40
    q, k_new, v_new, k_ws, v_ws, lengths = make_case(
        seqs, heads, kv_heads, dim, rows, tokens, dtype, seed=heads * dim
    )
    untouched = k_ws[:, seqs:].clone()
    scale = dim**-0.5
    out = torch.full((seqs, heads * dim), float("nan"), dtype=dtype)
    kernel(q, k_new, v_new, k_ws, v_ws, lengths, scale, out.view(seqs, heads, dim))
    for s in range(seqs):  # this step's K/V landed at position length - 1 of row s
        last = int(lengths[s]) - 1
        assert torch.equal(k_ws[:, s, last], k_new[s])
        assert torch.equal(v_ws[:, s, last], v_new[s])
    assert torch.equal(k_ws[:, seqs:], untouched)  # rows beyond the batch are not touched
    expected = reference(q, k_ws, v_ws, lengths, scale)
    got = out.view(seqs, heads, dim).double()
    assert torch.allclose(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("scale", [4.0, 40.0])
def test_peaked_scores_match_the_reference(kernel, scale):
    """Scores hundreds apart: the vector exp must give 0 far below a row's max (not a
    denormal, not NaN) and keep the rows whose probabilities are near one-hot exact."""
    seqs, heads, kv_heads, dim, tokens = 4, 8, 4, 64, 70
    q, k_new, v_new, k_ws, v_ws, lengths = make_case(
        seqs, heads, kv_heads, dim, seqs, tokens, torch.float32, seed=int(scale)
    )
    out = torch.empty(seqs, heads, dim)
    kernel(q, k_new, v_new, k_ws, v_ws, lengths, scale, out)
    assert torch.isfinite(out).all()
    expected = reference(q, k_ws, v_ws, lengths, scale)
    assert torch.allclose(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_refuses_shapes_it_would_read_past(kernel):
    q, k_new, v_new, k_ws, v_ws, lengths = make_case(3, 4, 2, 64, 3, 8, torch.float32, seed=1)
    out = torch.empty_like(q)
    too_long = lengths.clone()
    too_long[1] = 9  # beyond the row's 8 tokens
    with pytest.raises(RuntimeError, match="length outside"):
        kernel(q, k_new, v_new, k_ws, v_ws, too_long, 0.125, out)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(q.double(), k_new, v_new, k_ws, v_ws, lengths, 0.125, out)
    small = k_ws[:, :2].contiguous()
    with pytest.raises(RuntimeError, match="more queries than workspace rows"):
        kernel(q, k_new, v_new, small, small, lengths, 0.125, out)


@pytest.fixture(scope="module")
def paged():
    k = native.paged_decode_attention()
    assert k is not None, "the native kernel did not build (see the log)"
    return k


def make_paged_case(seqs, heads, kv_heads, dim, block_size, num_blocks, dtype, seed):
    """A paged cache and, per sequence, a shuffled table of distinct blocks and a length
    (1; a block and one more; a whole table; others at random)."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen).to(dtype)
    width = 6
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(seqs)])
    lengths = torch.randint(1, width * block_size + 1, (seqs,), generator=gen)
    lengths[0], lengths[1], lengths[-1] = 1, block_size + 1, width * block_size
    q = torch.randn(seqs, heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, lengths


def paged_reference(q, k_cache, v_cache, tables, lengths, block_size, scale):
    seqs, heads, dim = q.shape
    group = heads // k_cache.shape[0]
    out = torch.empty(seqs, heads, dim, dtype=torch.float64)
    for s in range(seqs):
        n = int(lengths[s])
        slots = (tables[s][:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        for h in range(heads):
            keys, values = k_cache[h // group, slots].double(), v_cache[h // group, slots].double()
            out[s, h] = torch.softmax(keys @ q[s, h].double() * scale, dim=0) @ values
    return out


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
# 5: runs of odd length in the middle of a sequence (bf16 weighs values two keys at a time)
@pytest.mark.parametrize("block_size", [16, 4, 32, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 4, 64), (6, 3, 128), (4, 1, 32), (12, 2, 64)])
def test_paged_reads_the_blocks_in_place(paged, dtype, tol, block_size, heads, kv_heads, dim):
    seqs = 5
    q, k_cache, v_cache, tables, lengths = make_paged_case(
        seqs, heads, kv_heads, dim, block_size, 40, dtype, seed=block_size + dim
    )
    before = k_cache.clone()
    scale = dim**-0.5
    out = torch.full((seqs, heads, dim), float("nan"), dtype=dtype)
    paged(q, k_cache, v_cache, tables, lengths, block_size, scale, out)
    assert torch.equal(k_cache, before)  # read only
    expected = paged_reference(q, k_cache, v_cache, tables, lengths, block_size, scale)
    assert torch.allclose(out.double(), expected, atol=tol, rtol=tol)


def test_paged_refuses_what_it_would_read_past(paged):
    q, k_cache, v_cache, tables, lengths = make_paged_case(3, 4, 2, 64, 16, 10, torch.float32, 1)
    out = torch.empty_like(q)
    too_long = lengths.clone()
    too_long[1] = 6 * 16 + 1  # beyond the table
    with pytest.raises(RuntimeError, match="beyond the block table"):
        paged(q, k_cache, v_cache, tables, too_long, 16, 0.125, out)
    bad = tables.clone()
    bad[0, 0] = 10  # a block the cache does not have
    with pytest.raises(RuntimeError, match="block id out of range"):
        paged(q, k_cache, v_cache, bad, lengths, 16, 0.125, out)
    with pytest.raises(RuntimeError, match="int64 block tables"):
        paged(q, k_cache, v_cache, tables.int(), lengths, 16, 0.125, out)
