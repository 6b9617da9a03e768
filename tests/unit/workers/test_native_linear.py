"""The native linear layers against a float64 reference and torch's linear, fp32 and bf16.

On a CPU with AVX-512 (bf16: and AVX512-BF16) or AVX2 the kernel must be built: the test fails,
not skips, if it is not (the engine would silently run oneDNN's slower small-batch path);
elsewhere it must say it is absent."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.cpu import runs_native_kernels
from workers.runner import native
from workers.runner.model import LayerWeights, ModelWeights
from workers.runner.packing import can_pack, pack_weights, packed_linear

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def kernel_for(dtype: torch.dtype):
    name = str(dtype).removeprefix("torch.")
    k = native.linear(name)
    if not runs_native_kernels(name):
        assert k is None
        pytest.skip(f"this CPU cannot run the {name} kernel: checked that it says so")
    assert k is not None, "the native kernel did not build (see the log)"
    return k


def weights(n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)


@DTYPES
def test_packing_round_trips(dtype):
    kernel = kernel_for(dtype)
    w = weights(192, 96, dtype, seed=1)
    packed = kernel.pack(w)
    if dtype == torch.bfloat16:  # input dims in pairs: one VDPBF16PS each
        assert packed.shape == (3, 48, 64, 2)
        assert packed[1, 5, 7].tolist() == w[64 + 7, 10:12].tolist()
    else:
        assert packed.shape == (3, 96, 64)
        assert packed[1, 10, 7].item() == w[64 + 7, 10].item()
    assert torch.equal(kernel.unpack(packed), w)


# 1-5 rows take the kernel's narrow tiles, 6+ its 6-row tile, 7, 65 and 700 (more than one
# block of rows) both; 700 x 1410 is also more than one block of x.
@DTYPES
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 64, 65, 700])
@pytest.mark.parametrize("n,k", [(64, 96), (192, 512), (128, 1410)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_and_torch(dtype, rows, n, k, bias):
    kernel = kernel_for(dtype)
    gen = torch.Generator().manual_seed(rows * n + k)
    w = weights(n, k, dtype, seed=k)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    # x as the model hands rows over: here a view whose rows are apart by more than k.
    x = torch.randn(rows, k + 6, generator=gen).to(dtype)[:, 3 : 3 + k]
    got = kernel.linear(x, kernel.pack(w), b)
    assert got.dtype == dtype and got.shape == (rows, n)
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    if dtype == torch.bfloat16:  # fp32 sums rounded once: within a bf16 rounding
        assert torch.allclose(got.double(), exact, rtol=2**-8, atol=1e-3)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=2**-7, atol=2e-3)
    else:
        assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_run():
    kernel = kernel_for(torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.pack(weights(100, 64, torch.float32, seed=2))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        kernel.pack(weights(64, 64, torch.float64, seed=2))
    packed = kernel.pack(weights(64, 64, torch.float32, seed=2))
    with pytest.raises(RuntimeError, match="columns"):
        kernel.linear(torch.randn(2, 32), packed)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernel.linear(torch.randn(64, 2).t(), packed)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel.linear(torch.randn(2, 64).bfloat16(), packed)


def one_layer_model(dtype, intermediate: int) -> tuple[LayerWeights, ModelWeights]:
    """A model of one layer, hidden 128: qkv 192 rows and o 128 (both for our tiles),
    gate_up 2 x intermediate rows, down 128 x intermediate."""
    layer = LayerWeights(
        input_norm=torch.ones(128),
        qkv=weights(192, 128, dtype, 3),
        qkv_bias=None,
        q_norm=None,
        k_norm=None,
        o=weights(128, 64, dtype, 4),
        post_norm=torch.ones(128),
        gate_up=weights(2 * intermediate, 128, dtype, 5),
        down=weights(128, intermediate, dtype, 6),
    )
    return layer, ModelWeights(torch.zeros(10, 128, dtype=dtype), [layer], torch.ones(128), layer.o)


@DTYPES
def test_the_model_packs_what_the_kernel_takes_and_oneDNN_the_rest(dtype):
    """Matrices with a multiple of 64 rows go to our tiles, any other to oneDNN's layout
    (left dense where oneDNN cannot run the dtype: bf16 on an AVX2 CPU); `packed_linear`
    runs each in its own kernel, and all agree with F.linear."""
    kernel = kernel_for(dtype)
    onednn = can_pack(torch.device("cpu"), dtype)
    layer, model = one_layer_model(dtype, intermediate=50)  # gate_up 100 rows: not our tiles
    packed = pack_weights(model, kernel, onednn).layers[0]
    assert not packed.qkv.is_mkldnn and not packed.o.is_mkldnn
    assert packed.qkv.dim() > 2
    assert packed.gate_up.is_mkldnn == onednn
    assert onednn or torch.equal(packed.gate_up, layer.gate_up)
    x = torch.randn(3, 128).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for name in ("qkv", "gate_up"):
        want = F.linear(x, getattr(layer, name))
        torch.testing.assert_close(packed_linear(x, getattr(packed, name), None), want, **tol)


def silu_mul_reference(x, w):
    """silu(x W_gate^T) * (x W_up^T) in float64, W = [gate; up]."""
    gate, up = (x.double() @ w.double().t()).chunk(2, dim=-1)
    return F.silu(gate) * up


@DTYPES
def test_gated_packing_round_trips(dtype):
    kernel = kernel_for(dtype)
    w = weights(256, 96, dtype, seed=7)
    packed = kernel.pack_gated(w)
    pair = 2 if dtype == torch.bfloat16 else 1
    assert packed.shape == (2, 2, 96 // pair, 64, pair)  # (gate tile, up tile) pairs
    # [pair, gate or up, input step, column, dim of the step]: up's row 64 + 7 of the 128
    assert packed[1, 1, 3, 7, pair - 1].item() == w[128 + 64 + 7, 3 * pair + pair - 1].item()
    assert torch.equal(kernel.unpack(packed), w)
    with pytest.raises(RuntimeError, match="halves of a multiple of 64"):
        kernel.pack_gated(weights(192, 96, dtype, seed=7))  # halves of 96 rows


@DTYPES
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 64, 65, 700])
@pytest.mark.parametrize("n,k", [(128, 96), (384, 1410)])
def test_linear_silu_is_the_two_pass_mlp_up(dtype, rows, n, k):
    """One pass through the (gate, up) pairs gives the same bits as the two-pass path
    (linear, then fused_ops.silu_mul) in both dtypes: the same sums, rounded where the
    two-pass path stores them, and the same SiLU (vec_math.h's). fp32 shows any difference
    in their arithmetic; bf16 only where a value lies by a rounding tie (on Sapphire Rapids,
    SiLUs an ulp apart gave one such value of 134,400 at 700 rows). fp32 is also within its
    own error of float64."""
    kernel, fused = kernel_for(dtype), native.fused_ops()
    assert fused is not None
    gen = torch.Generator().manual_seed(rows + n + k)
    w = weights(n, k, dtype, seed=k + 1)
    x = torch.randn(rows, k + 6, generator=gen).to(dtype)[:, 3 : 3 + k]
    got = kernel.linear_silu(x, kernel.pack_gated(w))
    two_pass = fused.silu_mul(kernel.linear(x, kernel.pack(w)))
    assert got.dtype == dtype and got.shape == (rows, n // 2)
    assert torch.equal(got, two_pass)
    if dtype == torch.float32:
        assert torch.allclose(got.double(), silu_mul_reference(x, w), rtol=1e-5, atol=1e-5)


def every_bf16_value() -> torch.Tensor:
    """The 65,280 finite bf16 values, denormals and the largest included."""
    v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return v[torch.isfinite(v)]


@DTYPES
def test_linear_silu_is_the_two_pass_mlp_up_at_every_bf16_gate(dtype):
    """Rows [v, r] against gate rows [1, 0] and up rows [0, s]: gate v for every finite bf16
    v (bf16: 0 for a denormal, which VDPBF16PS reads as 0), up r s. The SiLU's and product's
    roundings at tiny, huge and near-tie values agree bit for bit with the two-pass path."""
    kernel, fused = kernel_for(dtype), native.fused_ops()
    assert fused is not None
    gen = torch.Generator().manual_seed(0)
    v = every_bf16_value()
    x = torch.stack([v.float(), torch.randn(len(v), generator=gen)], dim=1).to(dtype)
    w = torch.zeros(128, 2)
    w[:64, 0] = 1
    w[64:, 1] = torch.randn(64, generator=gen)
    w = w.to(dtype)
    two_pass = fused.silu_mul(kernel.linear(x, kernel.pack(w)))
    assert torch.equal(kernel.linear_silu(x, kernel.pack_gated(w)), two_pass)


def test_linear_silu_refuses_what_it_cannot_run():
    kernel = kernel_for(torch.float32)
    plain = kernel.pack(weights(128, 64, torch.float32, seed=2))
    with pytest.raises(RuntimeError, match="pack_gated"):
        kernel.linear_silu(torch.randn(2, 64), plain)
    gated = kernel.pack_gated(weights(128, 64, torch.float32, seed=2))
    with pytest.raises(RuntimeError, match="columns"):
        kernel.linear_silu(torch.randn(2, 32), gated)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel.linear_silu(torch.randn(2, 64).bfloat16(), gated)


@DTYPES
@pytest.mark.parametrize("intermediate", [128, 50])
def test_the_model_runs_its_mlp_up_in_one_pass_where_it_can(dtype, intermediate):
    """A gate_up whose halves are a multiple of 64 rows goes into tile pairs and runs in
    one pass (`gated_mlp_up`); another goes to oneDNN and through silu_mul: both agree
    with silu(gate) * up."""
    from workers.runner.ops import TorchOps
    from workers.runner.packing import gated_mlp_up

    kernel = kernel_for(dtype)
    layer, model = one_layer_model(dtype, intermediate)
    gate_up = layer.gate_up
    onednn = can_pack(torch.device("cpu"), dtype)
    packed = pack_weights(model, kernel, onednn).layers[0].gate_up
    assert packed.dim() == (5 if intermediate % 64 == 0 else 2)
    assert packed.is_mkldnn == (onednn and intermediate % 64 != 0)
    x = torch.randn(9, 128).to(dtype)
    got = gated_mlp_up(x, packed, packed_linear, TorchOps(1e-6))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.double(), silu_mul_reference(x, gate_up), **tol)
