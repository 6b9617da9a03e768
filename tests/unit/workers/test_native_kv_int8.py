"""The int8 KV cache's native kernels (`kv_int8.cpp`) against torch (`workers.runner.kv_int8`)
and a float64 attention over the dequantized rows, in this CPU's build and, on an AVX-512
CPU, in builds of the AVX2 and scalar paths too (as a Zen 3 or another CPU would run them).

The native build must succeed here (the test fails, not skips: the engine would silently
run int8 KV in torch everywhere)."""

import pytest
import torch

from tests.support.native_variants import build_variant, can_run
from workers.runner import native
from workers.runner.kv_int8 import dequantize, quantize

VARIANTS = ["native", "avx2", "scalar"]


@pytest.fixture(scope="module", params=VARIANTS)
def kernels(request):
    if request.param == "native":
        module = native.kv_int8()
        assert module is not None, "the native kernel did not build (see the log)"
        return module
    if not can_run(request.param):
        pytest.skip(f"the {request.param} path is this CPU's native build, or it cannot run it")
    return build_variant("kv_int8", request.param)


def int8_store(shape, gen, spread=True):
    """Random rows quantized as the write would: (data, scale) of `shape` [..., dim]; rows'
    magnitudes vary by up to 50x when `spread`, as keys' do across tokens."""
    x = torch.randn(shape, generator=gen)
    if spread:
        x = x * torch.rand(shape[:-1] + (1,), generator=gen).mul(4).exp().div(10)
    return quantize(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 128, 48])
def test_write_quantizes_to_torchs_bits_and_hands_back_what_it_stored(kernels, dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    tokens, heads, slots = 37, 3, 64
    # k strided as rope leaves it, v a slice of the fused qkv; row 5 of k all zeros, row 6
    # of v one large value among small ones (it sets the scale, the rest round to 0 or 1).
    k = (torch.randn(tokens, heads, dim, generator=gen) * 3).to(dtype)
    k[5] = 0
    qkv = torch.randn(tokens, 3 * heads * dim, generator=gen).to(dtype)
    v = qkv[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    v[6, 1] = 1e-3
    v[6, 1, 7] = 50.0
    slots = torch.randperm(slots, generator=gen)[:tokens]
    caches = [torch.zeros(heads, 64, dim, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(heads, 64, dtype=torch.bfloat16) for _ in range(2)]
    k0, v0 = k.clone(), v.clone()
    kernels.write_kv(caches[0], scales[0], caches[1], scales[1], k, v, slots)
    for x0, x, data, scale in ((k0, k, caches[0], scales[0]), (v0, v, caches[1], scales[1])):
        want_q, want_s = quantize(x0)
        assert torch.equal(data[:, slots], want_q.transpose(0, 1))
        assert torch.equal(scale[:, slots], want_s.transpose(0, 1))
        assert torch.equal(x, dequantize(want_q, want_s, dtype))  # handed back as stored
        # Each value within half a step of its row's scale (plus the dtype's rounding).
        step = want_s.float().unsqueeze(-1)
        err = (x0.float() - dequantize(want_q, want_s, torch.float32)).abs()
        assert (err <= step * 0.5001 + 1e-30).all()
    assert (caches[0][:, slots[5]] == 0).all() and (scales[0][:, slots[5]] == 0).all()
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert (caches[0][:, untouched] == 0).all()


def test_quantize_fills_the_int8_range_and_never_clips():
    x = torch.randn(1000, 64) * torch.rand(1000, 1) * 100
    q, scale = quantize(x)
    assert q.abs().amax(-1).min() >= 126  # each row's largest value maps to about 127
    assert q.abs().max() <= 127
    assert torch.allclose(dequantize(q, scale, torch.float32), x, rtol=0, atol=x.abs().max() / 250)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dequantize_blocks_matches_torch(kernels, dtype):
    gen = torch.Generator().manual_seed(3)
    heads, block, num_blocks, dim = 3, 4, 12, 64
    data, scale = int8_store((heads, num_blocks * block, dim), gen)
    ids = torch.tensor([7, 2, 11, 0, 3])
    out = torch.empty(heads, len(ids) * block, dim, dtype=dtype)
    kernels.dequantize_blocks(data, scale, ids, block, out)
    rows = torch.cat([torch.arange(b * block, (b + 1) * block) for b in ids.tolist()])
    assert torch.equal(out, dequantize(data[:, rows], scale[:, rows], dtype))


def reference(q, keys, values):
    """float64 attention of each sequence's query heads over its keys/values, given as lists
    of [kv_heads, n_s, dim] float tensors (already dequantized)."""
    seqs, heads, dim = q.shape
    out = torch.empty(seqs, heads, dim, dtype=torch.float64)
    for s in range(seqs):
        group = heads // keys[s].shape[0]
        for h in range(heads):
            k, v = keys[s][h // group].double(), values[s][h // group].double()
            p = torch.softmax(k @ q[s, h].double() * dim**-0.5, dim=0)
            out[s, h] = p @ v
    return out


TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}
SHAPES = [  # (query heads, KV heads, dim): groups of 1, 2, 3, 4, 5 query heads per KV head
    (4, 4, 64),
    (8, 4, 64),
    (9, 3, 64),
    (8, 2, 128),
    (10, 2, 128),
    (6, 2, 32),
    (4, 2, 48),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 100, 530])
def test_workspace_attention_matches_reference_and_copies_the_new_token(
    kernels, dtype, heads, kv_heads, dim, tokens
):
    gen = torch.Generator().manual_seed(heads * dim + tokens)
    seqs, rows, slots = 3, 4, 32
    kw, kws = int8_store((kv_heads, rows, tokens, dim), gen)
    vw, vws = int8_store((kv_heads, rows, tokens, dim), gen)
    kc, kcs = int8_store((kv_heads, slots, dim), gen)
    vc, vcs = int8_store((kv_heads, slots, dim), gen)
    cache_slots = torch.tensor([5, 17, 30])
    lengths = torch.tensor([tokens, max(tokens // 2, 1), 1])
    q = torch.randn(seqs, heads, dim, generator=gen).to(dtype)
    untouched = kw[:, seqs:].clone()
    out = torch.full((seqs, heads, dim), float("nan"), dtype=dtype)
    kernels.decode_attention(
        q, kc, kcs, vc, vcs, cache_slots, kw, kws, vw, vws, lengths, dim**-0.5, out
    )
    for s in range(seqs):  # the cache's row at cache_slots[s] is now row s's last token
        last, slot = int(lengths[s]) - 1, int(cache_slots[s])
        assert torch.equal(kw[:, s, last], kc[:, slot]) and torch.equal(
            kws[:, s, last], kcs[:, slot]
        )
        assert torch.equal(vw[:, s, last], vc[:, slot]) and torch.equal(
            vws[:, s, last], vcs[:, slot]
        )
    assert torch.equal(kw[:, seqs:], untouched)
    n = lengths.tolist()
    keys = [dequantize(kw[:, s, : n[s]], kws[:, s, : n[s]], torch.float64) for s in range(seqs)]
    values = [dequantize(vw[:, s, : n[s]], vws[:, s, : n[s]], torch.float64) for s in range(seqs)]
    expected = reference(q, keys, values)
    tol = TOL[dtype]
    assert torch.allclose(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_reference(kernels, dtype, heads, kv_heads, dim, block_size):
    gen = torch.Generator().manual_seed(heads * dim + block_size)
    seqs, num_blocks, width = 5, 40, 9
    kc, kcs = int8_store((kv_heads, num_blocks * block_size, dim), gen)
    vc, vcs = int8_store((kv_heads, num_blocks * block_size, dim), gen)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(seqs)])
    # one key; a block and one more; whole tables; others at random
    lengths = torch.tensor([1, block_size + 1, width * block_size, 7, 3 * block_size - 2])
    q = torch.randn(seqs, heads, dim, generator=gen).to(dtype)
    out = torch.full((seqs, heads, dim), float("nan"), dtype=dtype)
    kernels.paged_decode_attention(q, kc, kcs, vc, vcs, tables, lengths, block_size, dim**-0.5, out)
    keys, values = [], []
    for s in range(seqs):
        n = int(lengths[s])
        rows = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in tables[s]])
        rows = rows[:n]
        keys.append(dequantize(kc[:, rows], kcs[:, rows], torch.float64))
        values.append(dequantize(vc[:, rows], vcs[:, rows], torch.float64))
    tol = TOL[dtype]
    assert torch.allclose(out.double(), reference(q, keys, values), atol=tol, rtol=tol)


def test_refuses_what_it_would_read_past(kernels):
    gen = torch.Generator().manual_seed(9)
    kc, kcs = int8_store((2, 32, 64), gen)
    tables = torch.tensor([[0, 1]])
    q = torch.randn(1, 4, 64)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="length beyond"):
        kernels.paged_decode_attention(q, kc, kcs, kc, kcs, tables, torch.tensor([9]), 4, 0.1, out)
    with pytest.raises(RuntimeError, match="block id out of range"):
        bad = torch.tensor([[0, 8]])
        kernels.paged_decode_attention(q, kc, kcs, kc, kcs, bad, torch.tensor([8]), 4, 0.1, out)
    with pytest.raises(RuntimeError, match="slot .* out of range"):
        k = torch.randn(1, 2, 64)
        kernels.write_kv(kc, kcs, kc.clone(), kcs.clone(), k, k.clone(), torch.tensor([32]))
    kw, kws = int8_store((2, 1, 8, 64), gen)
    with pytest.raises(RuntimeError, match="length outside the workspace row"):
        kernels.decode_attention(
            q, kc, kcs, kc, kcs, torch.tensor([0]), kw, kws, kw, kws, torch.tensor([9]), 0.1, out
        )
