"""The native bf16 linear layers against a float64 reference and torch's bf16 linear.

On a CPU with AVX512-BF16 the kernel must be built: the test fails, not skips, if it is
not (the engine would silently run oneDNN's slower small-batch path); elsewhere it must
say it is absent."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.cpu import has_avx512_bf16
from workers import native
from workers.model import ModelWeights, pack_weights, packed_linear


@pytest.fixture(scope="module")
def kernel():
    k = native.bf16_linear()
    if not has_avx512_bf16():
        assert k is None
        pytest.skip("this CPU has no AVX512-BF16: checked that the kernel says so")
    assert k is not None, "the native kernel did not build (see the log)"
    return k


def weights(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()


def test_packing_round_trips(kernel):
    w = weights(192, 96, seed=1)
    packed = kernel.pack(w)
    assert packed.shape == (3, 48, 64, 2)
    assert packed[1, 5, 7].tolist() == w[64 + 7, 10:12].tolist()  # columns 64 t + c, pair k/2
    assert torch.equal(kernel.unpack(packed), w)


# Row counts 1-3 take the kernel's narrow tiles, 4+ its 4-row tile, 7 and 65 both.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 64, 65])
@pytest.mark.parametrize("n,k", [(64, 96), (192, 512), (128, 1410)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_and_torch(kernel, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * n + k)
    w = weights(n, k, seed=k)
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    # x as the model hands rows over: here a view whose rows are apart by more than k.
    x = torch.randn(rows, k + 6, generator=gen).bfloat16()[:, 3 : 3 + k]
    got = kernel.linear(x, kernel.pack(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    # fp32 sums rounded once to bf16: within one bf16 rounding of the exact value.
    assert torch.allclose(got.double(), exact, rtol=2**-8, atol=1e-3)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=2**-7, atol=2e-3)


def test_refuses_what_it_cannot_run(kernel):
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.pack(weights(100, 64, seed=2))
    with pytest.raises(RuntimeError, match="bf16"):
        kernel.pack(weights(64, 64, seed=2).float())
    packed = kernel.pack(weights(64, 64, seed=2))
    with pytest.raises(RuntimeError, match="columns"):
        kernel.linear(torch.randn(2, 32).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernel.linear(torch.randn(64, 2).bfloat16().t(), packed)


def test_the_model_packs_what_the_kernel_takes_and_oneDNN_the_rest(kernel):
    """bf16 matrices with a multiple of 64 rows go to our tiles, any other to oneDNN's
    layout; `packed_linear` runs each in its own kernel, and both agree with F.linear."""
    from workers.model import LayerWeights

    dense = {"qkv": weights(192, 128, 3), "o": weights(128, 64, 4)}
    layer = LayerWeights(
        input_norm=torch.ones(128),
        qkv=dense["qkv"],
        qkv_bias=None,
        q_norm=None,
        k_norm=None,
        o=dense["o"],
        post_norm=torch.ones(128),
        gate_up=weights(100, 128, 5),  # 100 rows: not for our tiles
        down=weights(128, 50, 6),
    )
    model = ModelWeights(torch.zeros(10, 128).bfloat16(), [layer], torch.ones(128), dense["o"])
    packed = pack_weights(model, kernel).layers[0]
    assert packed.qkv.dim() == 4 and packed.o.dim() == 4
    assert packed.gate_up.is_mkldnn
    x = torch.randn(3, 128).bfloat16()
    for name in ("qkv", "gate_up"):
        want = F.linear(x, getattr(layer, name))
        torch.testing.assert_close(packed_linear(x, getattr(packed, name), None), want)
