"""The native fused per-layer ops against torch's (`workers.runner.ops.TorchOps`).

bf16 must agree but for rare steps of an ulp or two (RMSNorm's fp32 sum is reassociated,
SiLU's exp is vec_math.h's: one intermediate rounded the other way); fp32 to a few ulps.
Built here, or the test fails (it does not skip)."""

from types import SimpleNamespace

import pytest
import torch

from workers.runner import native
from workers.runner.ops import NativeOps, TorchOps

EPS = 1e-6


@pytest.fixture(scope="module")
def ops():
    fused = native.fused_ops()
    assert fused is not None, "the native fused ops did not build (see the log)"
    return NativeOps(fused, SimpleNamespace(rms_norm_eps=EPS)), TorchOps(EPS)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # within two bf16 ulps, and different at all on at most 1% of the values
        diff = (got.float() - want.float()).abs()
        ulp = want.float().abs().clamp(min=1e-30) * 2**-6
        assert bool((diff <= ulp).all())
        assert (diff > 0).float().mean().item() <= 0.01


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
ROWS = pytest.mark.parametrize("rows", [1, 7, 300])


@DTYPES
@ROWS
def test_norm_and_residual_add(ops, dtype, rows):
    native_ops, torch_ops = ops
    gen = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 96, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    close(native_ops.norm(h, weight), torch_ops.norm(h, weight), dtype)
    want_h, want_x = torch_ops.add_norm(h, delta, weight)
    got_h, got_x = native_ops.add_norm(h.clone(), delta, weight)
    assert torch.equal(got_h, want_h)  # the residual stream is one rounded add: exact
    close(got_x, want_x, dtype)


@DTYPES
@ROWS
def test_silu_mul(ops, dtype, rows):
    native_ops, torch_ops = ops
    gate_up = (torch.randn(rows, 2 * 80, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    close(native_ops.silu_mul(gate_up), torch_ops.silu_mul(gate_up), dtype)


@DTYPES
def test_silu_mul_at_every_bf16_gate(ops, dtype):
    """Every finite bf16 value as a gate (tiny, huge, both signs; rows of 83, so each ends
    in a partial vector): vec_math.h's SiLU, exp and division, agrees with torch's. Up in
    [0.25, 1), so that no product overflows."""
    native_ops, torch_ops = ops
    v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = v[torch.isfinite(v)][: 786 * 83].view(786, 83).to(dtype)
    up = (0.25 + 0.75 * torch.rand(786, 83, generator=torch.Generator().manual_seed(2))).to(dtype)
    gate_up = torch.cat([gate, up], dim=1)
    close(native_ops.silu_mul(gate_up), torch_ops.silu_mul(gate_up), dtype)


@DTYPES
@ROWS
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (6, 6, 64)])
def test_rope_on_strided_q_and_k(ops, dtype, rows, heads, kv_heads, dim):
    """q and k as the model hands them over: views into the fused qkv projection."""
    native_ops, torch_ops = ops
    gen = torch.Generator().manual_seed(dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    angles = torch.rand(rows, dim, generator=gen) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got_q, got_k = native_ops.rope(q, k, cos, sin)
    want_q, want_k = torch_ops.rope(q, k, cos, sin)
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)


def test_refuses_what_it_cannot_read(ops):
    fused = ops[0].fused
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        fused.rms_norm(x, torch.ones(7), EPS)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fused.silu_mul(x.double())
    with pytest.raises(RuntimeError, match="contiguous rows"):
        fused.rms_norm(x.t(), torch.ones(4), EPS)
    with pytest.raises(RuntimeError, match="residual"):
        fused.add_rms_norm_(x, torch.randn(3, 8), torch.ones(8), EPS)


@DTYPES
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_write_kv_stores_each_row_in_its_slot(ops, dtype, tokens):
    native_ops, torch_ops = ops
    gen = torch.Generator().manual_seed(tokens)
    heads, dim, num_slots = 4, 64, 512
    # k and v as the model has them: views of one fused qkv row, strided by token.
    qkv = torch.randn(tokens, 8 * dim + 2 * heads * dim, generator=gen).to(dtype)
    _, k, v = qkv.split([8 * dim, heads * dim, heads * dim], dim=-1)
    k, v = k.view(tokens, heads, dim), v.view(tokens, heads, dim)
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    caches = [torch.randn(heads, num_slots, dim, generator=gen).to(dtype) for _ in range(2)]
    got = [c.clone() for c in caches]
    want = [c.clone() for c in caches]
    native_ops.write_kv(*got, k, v, slots)
    torch_ops.write_kv(*want, k, v, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_write_kv_refuses_a_slot_outside_the_cache(ops):
    native_ops, _ = ops
    cache = torch.zeros(2, 16, 8)
    k = torch.ones(1, 2, 8)
    for slot in (16, -1):
        with pytest.raises(RuntimeError, match="out of range"):
            native_ops.write_kv(cache, cache.clone(), k, k, torch.tensor([slot]))
    assert not cache.any()


@pytest.mark.parametrize("vocab", [1, 17, 8192, 151_936])
def test_argmax_rows_matches_torch(ops, vocab):
    native_ops, torch_ops = ops
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(33, vocab, generator=gen) * 5
    # Ties (the first wins), a NaN (torch answers its index), rows of -inf, a maximum in
    # the last (unvectorised) columns, -0.0 against 0.0, and +inf.
    logits[1] = 2.0
    logits[2, vocab // 2] = float("nan")
    logits[3] = float("-inf")
    logits[4, -1] = 100.0
    logits[5] = 0.0
    logits[5, 0] = -0.0
    logits[6, :] = -1.0
    logits[6, vocab - 1] = float("nan")
    logits[7, vocab // 3] = float("inf")  # infinite, not NaN
    assert torch.equal(native_ops.argmax_rows(logits), torch_ops.argmax_rows(logits))
    # A view with a row stride (logits of every other row) reads the right rows.
    view = logits[::2]
    assert torch.equal(native_ops.argmax_rows(view), torch_ops.argmax_rows(view))
