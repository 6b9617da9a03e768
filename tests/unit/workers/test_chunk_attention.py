"""A prefill chunk after cached context reads its keys through a view of the paged cache
when its blocks are neighbours, and through a gathered copy otherwise: same result."""

import torch
import torch.nn.functional as F

from workers.runner.attention import AttentionMetadata, PrefillSeq, paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


def _attend(q, k, v, k_cache, v_cache, seq: PrefillSeq) -> torch.Tensor:
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), prefills=[seq])
    return paged_attention(q, k, v, 0, k_cache, v_cache, meta, BLOCK, DIM**-0.5)


def _reference(q, keys, values, context) -> torch.Tensor:
    """Plain attention of each chunk token over every key up to its position, in fp64."""
    n, total = q.shape[0], context + q.shape[0]
    group = HEADS // KV_HEADS
    k = keys[:, :total].double().repeat_interleave(group, 0)  # [heads, total, dim]
    v = values[:, :total].double().repeat_interleave(group, 0)
    scores = torch.einsum("nhd,htd->hnt", q.double(), k) * DIM**-0.5
    allowed = torch.arange(total)[None, :] <= (torch.arange(n) + context)[:, None]
    probs = F.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hnt,htd->nhd", probs, v).reshape(n, HEADS * DIM)


def test_a_run_of_neighbouring_blocks_is_read_as_a_view_with_the_gathers_result() -> None:
    torch.manual_seed(0)
    num_blocks, context, n = 32, 13, 6
    blocks_needed = -(-(context + n) // BLOCK)  # 5
    keys = torch.randn(KV_HEADS, blocks_needed * BLOCK, DIM)
    values = torch.randn(KV_HEADS, blocks_needed * BLOCK, DIM)
    q = torch.randn(n, HEADS, DIM)
    k_new = keys[:, context : context + n].transpose(0, 1).contiguous()
    v_new = values[:, context : context + n].transpose(0, 1).contiguous()

    def cache_with(table: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache = torch.randn(KV_HEADS, num_blocks * BLOCK, DIM)  # noise elsewhere
        v_cache = torch.randn(KV_HEADS, num_blocks * BLOCK, DIM)
        for i, b in enumerate(table):
            k_cache[:, b * BLOCK : (b + 1) * BLOCK] = keys[:, i * BLOCK : (i + 1) * BLOCK]
            v_cache[:, b * BLOCK : (b + 1) * BLOCK] = values[:, i * BLOCK : (i + 1) * BLOCK]
        return k_cache, v_cache

    run = [9, 10, 11, 12, 13]
    k_cache, v_cache = cache_with(run)
    ids = torch.tensor(run)
    viewed = _attend(q, k_new, v_new, k_cache, v_cache, PrefillSeq(0, n, context, ids, 9))
    gathered = _attend(q, k_new, v_new, k_cache, v_cache, PrefillSeq(0, n, context, ids))
    assert torch.equal(viewed, gathered)
    assert torch.allclose(viewed.double(), _reference(q, keys, values, context), atol=1e-5)

    scattered = [20, 3, 17, 4, 30]
    k_cache, v_cache = cache_with(scattered)
    seq = PrefillSeq(0, n, context, torch.tensor(scattered))
    assert torch.allclose(_attend(q, k_new, v_new, k_cache, v_cache, seq), gathered, atol=1e-6)


def test_whole_prompts_over_the_limit_go_to_sdpa_and_other_chunks_to_the_kernel() -> None:
    """`sdpa_prompts_over` (an AVX2 CPU's runner sets it): a whole prompt longer than it
    takes SDPA's causal kernel; a shorter one, and a chunk after cached context of any
    length, take `prefill_kernel`. The kernel here records what it is given."""
    torch.manual_seed(1)
    taken: list[tuple[int, int]] = []

    def kernel(q, keys, values, scale, out) -> None:
        taken.append((q.shape[0], keys.shape[0]))
        out.zero_()

    short, long, context = 5, 9, 4
    rows = short + long + long
    q = torch.randn(rows, HEADS, DIM)
    k, v = torch.randn(rows, KV_HEADS, DIM), torch.randn(rows, KV_HEADS, DIM)
    k_cache = torch.randn(KV_HEADS, 16 * BLOCK, DIM)
    v_cache = torch.randn(KV_HEADS, 16 * BLOCK, DIM)
    after = PrefillSeq(short + long, long, context, torch.arange(4), first_block=0)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        prefills=[PrefillSeq(0, short, 0, None), PrefillSeq(short, long, 0, None), after],
        prefill_kernel=kernel,
        sdpa_prompts_over=short,
    )
    out = paged_attention(q, k, v, 0, k_cache, v_cache, meta, BLOCK, DIM**-0.5)
    assert taken == [(short, short), (long, context + long)]
    assert torch.all(out[:short] == 0) and torch.all(out[short + long :] == 0)
    # The long whole prompt went to SDPA: causal attention over its own keys.
    n = slice(short, short + long)
    keys, values = k[n].transpose(0, 1), v[n].transpose(0, 1)
    assert torch.allclose(out[n].double(), _reference(q[n], keys, values, 0), atol=1e-5)

    taken.clear()
    meta.sdpa_prompts_over = None  # AVX-512: every chunk on the kernel
    paged_attention(q, k, v, 0, k_cache, v_cache, meta, BLOCK, DIM**-0.5)
    assert taken == [(short, short), (long, long), (long, context + long)]
