"""The quantized linear layers (int8 per row, q4 per group of 32) against float64 on the
dequantized weights, in fp32 and bf16 activations, on this CPU's path and, on an AVX-512
machine, the AVX2 path of the same source (`tests/support/native_variants.py`); and
torch's fallback where the kernel does not take a shape.

On a CPU with AVX-512 or AVX2 the kernel must be built: the test fails, not skips, if it is
not (the engine would silently dequantize every weight on every call)."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.cpu import cpu_flags
from tests.support.native_variants import build_variant, can_run
from workers.runner import native
from workers.runner.quant import (
    Q4_GROUP,
    QuantizedWeight,
    quantize,
    quantize_int8,
    quantize_q4,
    quantized_linear,
    to_tiles,
    unpack_nibbles,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
KINDS = pytest.mark.parametrize("kind", ["int8", "q4"])


def runs_here() -> bool:
    flags = cpu_flags()
    return "avx512f" in flags or {"avx2", "fma", "f16c"} <= flags


@pytest.fixture(scope="module", params=["native", "avx2"])
def kernel(request):
    if request.param == "native":
        k = native.quant_linear()
        if not runs_here():
            assert k is None or k.path("float32") == ""
            pytest.skip("this CPU has no quantized kernel: checked that it says so")
        assert k is not None, "the quantized kernel did not build (see the log)"
        return k
    if not can_run("avx2"):  # Haswell's AVX2, FMA and F16C, on a CPU that builds AVX-512
        pytest.skip("the native build is this CPU's AVX2 path already, or it has none")
    k = build_variant("quant_linear", "avx2")
    assert k.path("float32") == k.path("bfloat16") == "avx2"
    return k


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * k**-0.5


def tiles(kernel, w: torch.Tensor, kind: str, gated: bool = False) -> QuantizedWeight:
    qw = to_tiles(quantize(w, kind), kernel, gated)
    assert qw.tiled and qw.gated == gated
    return qw


def run(kernel, x, qw: QuantizedWeight, bias=None):
    if qw.kind == "int8":
        return kernel.linear_int8(x, qw.data, qw.scales, bias)
    return kernel.linear_q4(x, qw.data, bias)


def test_int8_quantization_is_within_half_a_step_per_row():
    w = weights(96, 70, seed=1)
    w[3] = 0  # an all-zero row: scale 0, values 0
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(q[3], torch.zeros_like(q[3]))
    err = (q.float() * scales[:, None] - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-7).all()


def test_q4_quantization_is_within_half_a_step_per_group_and_pads_to_32():
    w = weights(64, 70, seed=2)
    w[5, :32] = 0.25  # a constant group: d 0, every value its minimum
    q, d, m = quantize_q4(w)
    assert q.shape == (64, 96) and d.shape == m.shape == (64, 3)
    assert q.dtype == torch.uint8 and q.max() <= 15
    assert d.dtype == m.dtype == torch.float16
    deq = (q.float().view(64, 3, 32) * d.float()[..., None] + m.float()[..., None]).view(64, 96)
    step = d.float().repeat_interleave(Q4_GROUP, dim=1)[:, :70]
    # m and d are rounded to fp16: half a step plus their rounding's share
    assert ((deq[:, :70] - w).abs() <= step / 2 + 16 * 2**-11 * w.abs().amax()).all()
    assert d[5, 0] == 0 and (deq[5, :32] == m[5, 0].float()).all()


def test_a_dequantized_q4_weight_quantizes_back_to_its_own_blocks():
    """A Q4_1 GGUF dequantized to float (the default model's checkpoint) holds, per block,
    d q + m with a 0 and a 15 among its q: quantized again, the same blocks come back, so
    the engine's q4 weights are the GGUF's, not a second rounding of them."""
    q, d, m = quantize_q4(weights(128, 256, seed=3))
    deq = (q.float().view(128, 8, 32) * d.float()[..., None] + m.float()[..., None]).view(128, 256)
    q2, d2, m2 = quantize_q4(deq)
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)


@KINDS
def test_packing_round_trips(kernel, kind):
    w = weights(256, 128, seed=4)
    qw = quantize(w, kind)
    tiled = to_tiles(qw, kernel)
    gated = to_tiles(qw, kernel, gated=True)  # (gate tile, up tile) pairs
    assert not to_tiles(quantize(w[:192], kind), kernel, gated=True).tiled  # halves of 96
    if kind == "int8":
        assert tiled.data.shape == (4, 128, 64) and tiled.data.dtype == torch.int8
        assert tiled.data[1, 10, 7].item() == qw.data[64 + 7, 10].item()
        assert gated.data.shape == (2, 2, 128, 64)
        for t in (tiled, gated):
            assert torch.equal(kernel.unpack_int8(t.data), qw.data)
    else:
        assert tiled.data.shape == (4, 4, 1280) and tiled.data.dtype == torch.uint8
        assert gated.data.shape == (2, 2, 4, 1280)
        assert tiled.scales is None and tiled.mins is None  # inside the tiles
        # column 16 j + c, dim parity p of step s: byte 16 (c / 4) + 8 (j % 2) + 2 (c % 4) + p
        values = unpack_nibbles(qw.data)
        col, s, p = 16 * 3 + 6, 5, 1  # j 3 (high nibble, unpacked high), c 6
        byte = tiled.data[1, 2, 256 + 64 * s + 16 * 1 + 8 * 1 + 2 * 2 + p]
        assert (byte >> 4).item() == values[64 + col, 64 + 2 * s + p].item()
        for t in (tiled, gated):
            got_q, got_d, got_m = kernel.unpack_q4(t.data)
            assert torch.equal(got_q, values)
            assert torch.equal(got_d, qw.scales) and torch.equal(got_m, qw.mins)
    assert torch.equal(tiled.dequantize(), qw.dequantize())


# 1-7 rows take every narrow block of the in-loop paths; 8 and more decode each tile once
# into fp32 (13 and 100: several blocks and a prefetch of the next tile); 700 is more than
# one block of rows. int8 takes any input dim, q4 whole groups of 32.
SHAPES = [(kind, n, k) for kind in ("int8", "q4") for n, k in [(64, 64), (192, 512), (128, 1408)]]


@pytest.mark.parametrize("kind,n,k", [*SHAPES, ("int8", 64, 33)])
@DTYPES
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 100, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_on_the_dequantized_weights(kernel, kind, dtype, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * n + k)
    qw = tiles(kernel, weights(n, k, seed=k), kind)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    # x as the model hands rows over: here a view whose rows are apart by more than k.
    x = torch.randn(rows, k + 6, generator=gen).to(dtype)[:, 3 : 3 + k]
    got = run(kernel, x, qw, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    exact = x.double() @ qw.dequantize().double().t() + (0 if b is None else b.double())
    if dtype == torch.bfloat16:  # fp32 sums rounded once: within a bf16 rounding
        assert torch.allclose(got.double(), exact, rtol=2**-8, atol=2e-3)
    else:
        assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)


@KINDS
@DTYPES
@pytest.mark.parametrize("rows", [1, 3, 7, 100])
@pytest.mark.parametrize("n,k", [(128, 96), (384, 1408)])
def test_linear_silu_is_the_two_pass_mlp_up(kernel, kind, dtype, rows, n, k):
    """One pass through the (gate, up) pairs gives the same bits as the linear and then
    fused_ops.silu_mul: the same sums, rounded where the two-pass path stores them."""
    fused = native.fused_ops()
    assert fused is not None
    gen = torch.Generator().manual_seed(rows + n + k)
    w = weights(n, k, seed=k + 1)
    plain, gated = tiles(kernel, w, kind), tiles(kernel, w, kind, gated=True)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    if kind == "int8":
        got = kernel.linear_silu_int8(x, gated.data, gated.scales)
    else:
        got = kernel.linear_silu_q4(x, gated.data)
    assert got.dtype == dtype and got.shape == (rows, n // 2)
    assert torch.equal(got, fused.silu_mul(run(kernel, x, plain)))


def test_refuses_what_it_cannot_run(kernel):
    q, scales = quantize_int8(weights(64, 64, seed=5))
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.pack_int8(q[:60])
    q4, d, m = quantize_q4(weights(64, 64, seed=5))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.pack_q4(q4[:, :48], d[:, :1], m[:, :1])
    with pytest.raises(RuntimeError, match="0..15"):
        kernel.pack_q4(q4 + 16, d, m)
    packed = kernel.pack_int8(q)
    with pytest.raises(RuntimeError, match="columns"):
        kernel.linear_int8(torch.randn(2, 32), packed, scales)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernel.linear_int8(torch.randn(64, 2).t(), packed, scales)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        kernel.linear_int8(torch.randn(2, 64).double(), packed, scales)
    with pytest.raises(RuntimeError, match="pack_q4"):
        kernel.linear_q4(torch.randn(2, 64), packed)
    with pytest.raises(RuntimeError, match="scales"):
        kernel.linear_int8(torch.randn(2, 64), packed, scales[:32])


@pytest.mark.parametrize(
    "kind,n,k", [("int8", 100, 70), ("int8", 37, 40), ("q4", 100, 70), ("q4", 64, 71)]
)
@DTYPES
def test_shapes_the_tiles_do_not_take_run_dequantized_by_torch(kind, dtype, n, k):
    """Rows not a multiple of 64, or input dims not a multiple of 32 (q4):
    the weight stays quantized in its plain layout and torch dequantizes it per call."""
    kernel = native.quant_linear()
    qw = quantize(weights(n, k, seed=n + k), kind)
    if kernel is not None:
        assert to_tiles(qw, kernel) is qw
    x = torch.randn(5, k).to(dtype)
    b = torch.randn(n).to(dtype)
    got = quantized_linear(x, qw, b)
    assert got.dtype == dtype and got.shape == (5, n)
    want = F.linear(x.double(), qw.dequantize().double(), b.double())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.double(), want, **tol)


@KINDS
def test_the_fallback_and_the_kernel_agree(kernel, kind):
    """The same quantized weight through torch's dequantization (another CPU, a GPU) and
    through the tiles."""
    qw = quantize(weights(192, 512, seed=6), kind)
    x = torch.randn(9, 512)
    torch.testing.assert_close(
        quantized_linear(x, qw, None), run(kernel, x, to_tiles(qw, kernel)), rtol=1e-5, atol=1e-5
    )
