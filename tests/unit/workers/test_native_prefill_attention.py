"""The native prompt-chunk attention kernel against a float64 reference and SDPA.

On a CPU with AVX-512 (bf16: and AVX512-BF16), or with AVX2 and FMA (both dtypes), it must
be built: the test fails, not skips, if it is not (the engine would silently run torch's
slower kernel); elsewhere it must say it is absent."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.cpu import runs_native_kernels
from workers.runner import native

DTYPES = pytest.mark.parametrize("dtype", ["float32", "bfloat16"])


def kernel_for(dtype: str, head_dim: int = 64):
    k = native.prefill_attention(dtype, head_dim)
    if not runs_native_kernels(dtype):  # this machine runs both; another must say so
        assert k is None
        pytest.skip(f"this CPU cannot run the {dtype} kernel: checked that it says so")
    assert k is not None, "the native kernel did not build (see the log)"
    return k


def make_case(nq, nk, heads, kv_heads, dim, dtype, seed):
    """q as the model has it; k and v as the cache holds them ([kv_heads, slots, dim]),
    viewed as [nk, kv_heads, dim]; a chunk's own keys are the last nq."""
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    q = torch.randn(nq, heads, dim, generator=gen).to(dt)
    cache = torch.randn(2, kv_heads, nk + 5, dim, generator=gen).to(dt)
    k, v = (c[:, :nk].transpose(0, 1) for c in cache)
    return q, k, v


def reference(q, k, v, scale):
    """Causal attention in float64: query i (at position nk - nq + i) over keys 0..that."""
    nq, heads, _ = q.shape
    nk = k.shape[0]
    group = heads // k.shape[1]
    qd, kd, vd = (t.double().transpose(0, 1) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
    scores = qd @ kd.transpose(1, 2) * scale
    scores.masked_fill_(torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1), float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(0, 1)


def sdpa(q, k, v, scale):
    nq, nk = q.shape[0], k.shape[0]
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    out = F.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (q, k, v)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


@DTYPES
@pytest.mark.parametrize(
    "nq,nk,heads,kv_heads,dim",
    [
        (1, 1, 8, 4, 64),  # one token sees only itself
        (2, 2, 8, 4, 64),  # an odd key pair
        (17, 17, 8, 4, 64),  # a key block and one more; a query block and one more
        (40, 40, 4, 4, 64),  # no grouping
        (33, 33, 6, 2, 64),  # groups of 3 (rows of a group span tokens unevenly)
        (70, 70, 8, 1, 128),  # one KV head, head dim 128
        (300, 300, 8, 4, 64),
        (24, 100, 8, 4, 64),  # a chunk after 76 tokens of cached context
        (1, 45, 8, 4, 128),  # one token after context
        (50, 530, 6, 2, 64),
    ],
)
def test_matches_float64_reference_as_closely_as_sdpa(dtype, nq, nk, heads, kv_heads, dim):
    kernel = kernel_for(dtype, dim)
    q, k, v = make_case(nq, nk, heads, kv_heads, dim, dtype, seed=nq + nk + heads)
    scale = dim**-0.5
    out = torch.full_like(q, float("nan"))
    kernel(q, k, v, scale, out)
    want = reference(q, k, v, scale)
    err = (out.double() - want).abs().max().item()
    theirs = sdpa(q, k, v, scale)
    sdpa_err = (theirs.double() - want).abs().max().item()
    if dtype == "float32":
        assert err < 1e-5, err
    else:
        # bf16 rounds the probabilities as torch's kernel does: the error is the order of
        # SDPA's own (a bf16 ulp of the output, ~0.008 at these magnitudes).
        assert err <= max(2 * sdpa_err, 1e-2), (err, sdpa_err)
        assert (out.float() - theirs.float()).abs().mean().item() < 2e-3


@DTYPES
@pytest.mark.parametrize("scale", [4.0, 40.0])
def test_peaked_scores_match_the_reference(dtype, scale):
    """Scores hundreds apart: the vector exp must give 0 far below a row's max (not a
    denormal, not NaN) and keep the near one-hot rows as the reference has them."""
    kernel = kernel_for(dtype)
    q, k, v = make_case(45, 60, 8, 4, 64, dtype, seed=int(scale))
    out = torch.full_like(q, float("nan"))
    kernel(q, k, v, scale, out)
    assert torch.isfinite(out.float()).all()
    want = reference(q, k, v, scale)
    err = (out.double() - want).abs().max().item()
    # Scores this large carry fp32's rounding into the exponent: SDPA errs as much.
    sdpa_err = (sdpa(q, k, v, scale).double() - want).abs().max().item()
    assert err <= max(2 * sdpa_err, 1e-5 if dtype == "float32" else 2e-2), (err, sdpa_err)


def test_refuses_what_it_cannot_run():
    kernel = kernel_for("float32")
    q, k, v = make_case(8, 8, 8, 4, 64, "float32", seed=0)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(q, k.bfloat16(), v, 0.125, out)
    assert native.prefill_attention("float32", 32) is None  # the engine runs SDPA there
    with pytest.raises(RuntimeError, match="head dim"):
        kernel(q[..., :32], k[..., :32], v[..., :32], 0.125, out[..., :32])
    with pytest.raises(RuntimeError, match="a key per query"):
        kernel(q, k[:4], v[:4], 0.125, out)
