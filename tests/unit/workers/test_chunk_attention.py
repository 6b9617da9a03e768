"""A prefill chunk after cached context reads its keys through a view of the paged cache
when its blocks are neighbours, and through a gathered copy otherwise: same result."""

import torch
import torch.nn.functional as F

from workers.attention import AttentionMetadata, PrefillSeq, paged_attention

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
