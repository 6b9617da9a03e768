"""The native bf16 whole-prompt attention kernel against a float64 reference and SDPA.

On a CPU with AVX512-BF16 it must be built (the test fails, not skips, if it is not: the
engine would silently run torch's slower kernel); elsewhere it must say it is absent."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.cpu import has_avx512_bf16
from workers import native


@pytest.fixture(scope="module")
def kernel():
    k = native.prefill_attention()
    if not has_avx512_bf16():
        assert k is None
        pytest.skip("this CPU has no AVX512-BF16: the engine runs SDPA (checked above)")
    assert k is not None, "the native kernel did not build (see the log)"
    return k


def make_case(n, heads, kv_heads, dim, seed):
    """q, k, v as the model has them: k and v slices of one fused row (strided by token)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim)


def reference(q, k, v, scale):
    """Causal attention in float64: query i over keys 0..i of its KV head."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    qd, kd, vd = (t.double().transpose(0, 1) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
    scores = qd @ kd.transpose(1, 2) * scale
    scores.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(0, 1)


@pytest.mark.parametrize(
    "n,heads,kv_heads,dim",
    [
        (1, 8, 4, 64),  # one token sees only itself
        (2, 8, 4, 64),  # an odd key pair
        (17, 8, 4, 64),  # a key block and one more; a query block and one more
        (40, 4, 4, 64),  # no grouping
        (33, 6, 2, 64),  # groups of 3 (rows of a group span tokens unevenly)
        (70, 8, 1, 128),  # one KV head, head dim 128
        (300, 8, 4, 64),
    ],
)
def test_matches_float64_reference_as_closely_as_sdpa(kernel, n, heads, kv_heads, dim):
    q, k, v = make_case(n, heads, kv_heads, dim, seed=n + heads)
    scale = dim**-0.5
    out = torch.full((n, heads, dim), float("nan"), dtype=torch.bfloat16)
    kernel(q, k, v, scale, out)
    want = reference(q, k, v, scale)
    sdpa = F.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (q, k, v)),
        is_causal=True,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )[0].transpose(0, 1)
    err = (out.double() - want).abs().max().item()
    sdpa_err = (sdpa.double() - want).abs().max().item()
    # The probabilities are rounded to bf16 as torch's kernel rounds them: the error is the
    # same order as SDPA's own (a bf16 ulp of the output, ~0.008 at these magnitudes).
    assert err <= max(2 * sdpa_err, 1e-2), (err, sdpa_err)
    assert (out.float() - sdpa.float()).abs().mean().item() < 2e-3


def test_refuses_what_it_cannot_run(kernel):
    q, k, v = make_case(8, 8, 4, 64, seed=0)
    out = torch.empty(8, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16"):
        kernel(q.float(), k.float(), v.float(), 0.125, out.float())
    with pytest.raises(RuntimeError, match="head dim"):
        kernel(q[..., :32], k[..., :32], v[..., :32], 0.125, out[..., :32])
