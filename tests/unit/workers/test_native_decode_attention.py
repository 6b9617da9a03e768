"""The native workspace decode-attention kernel against a float64 reference.

It must be built on this machine (the test fails, not skips, if it is not: the engine
would silently run the slower torch path everywhere)."""

import pytest
import torch

from workers import native


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
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 64), (6, 3, 128), (4, 1, 32)])
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
