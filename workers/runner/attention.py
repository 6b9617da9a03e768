"""Paged attention in plain PyTorch (runs on CPU and CUDA).

KV cache layout per layer: `[num_kv_heads, num_blocks * block_size, head_dim]`, so a
gather by block ids yields each head's keys contiguous in time, ready for a batched
matmul. Grouped-query attention is computed by viewing the query heads of one KV head
as a group, never by repeating K/V. An int8 cache (`kv_int8.Int8KV`) is read through its
own kernels or dequantized, wherever a float cache is read.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.runner.decode_workspace import DecodeWorkspace
from workers.runner.kv_int8 import Int8KV
from workers.runner.kv_int8 import write_kv as write_int8

KVCache = torch.Tensor | Int8KV  # one layer's K or V: [kv_heads, slots, dim]


@dataclass
class PrefillSeq:
    """One sequence's prefill chunk inside the flat token batch."""

    start: int  # first row of its tokens in the flat batch
    num_tokens: int  # tokens in this chunk (query length)
    num_context: int  # tokens already in the cache before this chunk
    # Blocks holding its num_context + num_tokens keys; None when there is no context.
    block_ids: torch.Tensor | None
    # When those blocks are one run of neighbouring ids (the scheduler takes a prompt's
    # blocks at once, and the pool hands them out in order), the first: attention reads
    # the cache through a view instead of gathering a copy of the context every layer.
    first_block: int | None = None
    # Offset-causal mask, built by the first layer and reused by the others.
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """How the flat batch of one step maps onto sequences and cache slots.

    Rows of the flat batch: workspace decodes, then gather decodes, then prefill chunks.
    """

    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's K/V is written to
    prefills: list[PrefillSeq]
    # The native kernel (`workers.runner.native.prefill_attention`) for prompt chunks: (q, keys,
    # values, scale, out), the chunk's queries last in time; None = SDPA.
    prefill_kernel: Callable[..., None] | None = None
    # Whole prompts longer than this go to SDPA's causal kernel even where `prefill_kernel`
    # runs (None: never); chunks after cached context stay on the kernel (SDPA needs a
    # mask there, 2.3x slower).
    sdpa_prompts_over: int | None = None
    # Decodes that read their rows of the decode workspace (in row order).
    num_workspace_decodes: int = 0
    workspace: DecodeWorkspace | None = None
    workspace_slots: torch.Tensor | None = None  # [n] flat workspace slot of each new token
    workspace_mask: torch.Tensor | None = None  # [n, T] True = attend
    # The native kernel (`workers.runner.native.decode_attention`) that appends and attends in
    # one pass, with each row's length after this step; None = torch (append + SDPA).
    workspace_kernel: Callable[..., None] | None = None
    workspace_lengths: torch.Tensor | None = None  # [n] int64
    # Decodes without a workspace row, reading their blocks of the paged cache.
    num_gather_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [n, max_blocks] int64 (padded with 0)
    # The native kernel (`workers.runner.native.paged_decode_attention`) that reads the blocks in
    # place, with each row's length after this step; None = torch (gather + SDPA, masked).
    paged_kernel: Callable[..., None] | None = None
    decode_lengths: torch.Tensor | None = None  # [n] int64
    decode_mask: torch.Tensor | None = None  # [n, max_blocks * block_size] True = attend


def write_kv(
    k_cache: KVCache,
    v_cache: KVCache,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store new keys/values ([tokens, kv_heads, dim]) into their cache slots (an int8
    cache also gives k and v back as it stores them: `kv_int8.write_kv`)."""
    if isinstance(k_cache, Int8KV):
        assert isinstance(v_cache, Int8KV)
        write_int8(k_cache, v_cache, k, v, slots)
        return
    assert isinstance(v_cache, torch.Tensor)
    k_cache[:, slots] = k.transpose(0, 1)
    v_cache[:, slots] = v.transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    k_cache: KVCache,
    v_cache: KVCache,
    meta: AttentionMetadata,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention for a flat batch: q [tokens, heads, dim], k/v [tokens, kv_heads, dim].

    k/v are this step's new keys and values (already written to the cache). Returns
    [tokens, heads * dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = q.new_empty(num_tokens, num_heads * head_dim)
    nw, ng = meta.num_workspace_decodes, meta.num_gather_decodes
    # An int8 cache: a workspace row's new token is copied as the cache stores it.
    int8 = isinstance(k_cache, Int8KV)
    if nw and meta.workspace_kernel is not None:
        ws, lengths = meta.workspace, meta.workspace_lengths
        assert ws is not None and lengths is not None
        rows = out[:nw].view(nw, num_heads, head_dim)
        kw, vw = ws.k[layer], ws.v[layer]
        if int8:
            slots = meta.slot_mapping[:nw]
            meta.workspace_kernel(q[:nw], k_cache, v_cache, slots, kw, vw, lengths, scale, rows)
        else:
            meta.workspace_kernel(q[:nw], k[:nw], v[:nw], kw, vw, lengths, scale, rows)
    elif nw:
        ws, mask = meta.workspace, meta.workspace_mask
        assert ws is not None and mask is not None and meta.workspace_slots is not None
        if int8:
            slots = meta.slot_mapping[:nw]
            ws.append(layer, k_cache.rows(slots), v_cache.rows(slots), meta.workspace_slots)
        else:
            ws.append(layer, k[:nw], v[:nw], meta.workspace_slots)
        keys, values = ws.view(layer, nw, mask.shape[1])
        out[:nw] = _grouped_decode(q[:nw], keys, values, mask, scale, group)
    if ng and meta.paged_kernel is not None:
        rows = slice(nw, nw + ng)
        meta.paged_kernel(
            q[rows],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_lengths,
            block_size,
            scale,
            out[rows].view(ng, num_heads, head_dim),
        )
    elif ng:
        rows = slice(nw, nw + ng)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, meta, block_size, scale, group)
    for seq in meta.prefills:
        rows = slice(seq.start, seq.start + seq.num_tokens)
        if meta.prefill_kernel is not None and not _sdpa_prompt(seq, meta):
            keys, values = _chunk_keys(k[rows], v[rows], k_cache, v_cache, seq, block_size)
            view = out[rows].view(seq.num_tokens, num_heads, head_dim)
            meta.prefill_kernel(q[rows], keys, values, scale, view)
            continue
        out[rows] = _prefill_attention(
            q[rows], k[rows], v[rows], k_cache, v_cache, seq, block_size, scale, group
        )
    return out


def _sdpa_prompt(seq: PrefillSeq, meta: AttentionMetadata) -> bool:
    """Whether this chunk is a whole prompt long enough to go to SDPA's causal kernel."""
    over = meta.sdpa_prompts_over
    return over is not None and seq.num_context == 0 and seq.num_tokens > over


def _decode_attention(
    q: torch.Tensor,
    k_cache: KVCache,
    v_cache: KVCache,
    meta: AttentionMetadata,
    block_size: int,
    scale: float,
    group: int,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    tables = meta.decode_block_tables
    assert tables is not None and meta.decode_mask is not None
    # index_select over whole blocks (block_size * dim contiguous values) is several times
    # faster on CPU than advanced indexing. Result: [kv_heads, seqs, T, dim], contiguous.
    flat = tables.flatten()
    out_shape = (num_kv_heads, num_seqs, -1, head_dim)
    keys = _blocks(k_cache, flat, block_size).view(out_shape)
    values = _blocks(v_cache, flat, block_size).view(out_shape)
    return _grouped_decode(q, keys, values, meta.decode_mask, scale, group)


def _grouped_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    group: int,
) -> torch.Tensor:
    """One query token per sequence; keys/values [kv_heads, seqs, T, dim], mask [seqs, T]."""
    num_seqs, num_heads, head_dim = q.shape
    query = q.view(num_seqs, num_heads // group, group, head_dim).transpose(0, 1)
    attn = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask[None, :, None, :], scale=scale
    )
    return attn.transpose(0, 1).reshape(num_seqs, num_heads * head_dim)


def _blocks(cache: KVCache, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Blocks `block_ids` of one layer's K or V, in order: [kv_heads, n * block_size, dim]
    (an int8 cache's dequantized)."""
    if isinstance(cache, Int8KV):
        return cache.blocks(block_ids, block_size)
    num_kv_heads, _, head_dim = cache.shape
    shape = (num_kv_heads, -1, block_size * head_dim)
    return torch.index_select(cache.view(shape), 1, block_ids).view(num_kv_heads, -1, head_dim)


def _context_keys(
    k_cache: KVCache, v_cache: KVCache, seq: PrefillSeq, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """All keys and values of a chunk after cached context ([kv_heads, T, dim], T covering
    whole blocks): a view of the cache when its blocks are neighbours, else gathered whole
    blocks at a time (far faster than per-slot indexing). An int8 cache's are dequantized
    copies either way."""
    assert seq.block_ids is not None
    if seq.first_block is not None and not isinstance(k_cache, Int8KV):
        assert isinstance(v_cache, torch.Tensor)
        start = seq.first_block * block_size
        span = slice(start, start + len(seq.block_ids) * block_size)
        return k_cache[:, span], v_cache[:, span]
    return _blocks(k_cache, seq.block_ids, block_size), _blocks(v_cache, seq.block_ids, block_size)


def _chunk_keys(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: KVCache,
    v_cache: KVCache,
    seq: PrefillSeq,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a chunk attends over, [tokens, kv_heads, dim], its own last: the
    chunk's (a whole prompt) or the cache's first num_context + num_tokens."""
    if seq.num_context == 0:
        return k, v
    keys, values = _context_keys(k_cache, v_cache, seq, block_size)
    total = seq.num_context + seq.num_tokens
    return keys[:, :total].transpose(0, 1), values[:, :total].transpose(0, 1)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: KVCache,
    v_cache: KVCache,
    seq: PrefillSeq,
    block_size: int,
    scale: float,
    group: int,
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if seq.num_context == 0:
        # A whole prompt: plain causal attention, which SDPA's fused kernel runs without a
        # mask, skipping the blocks above the diagonal (2.3x faster at 2,048 tokens than
        # the masked call below, and the same bits).
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=group > 1,
        )
        return attn[0].transpose(0, 1).reshape(n, num_heads * head_dim)
    # [1, kv_heads, group * n, dim]: the query heads that share a KV head, stacked in
    # time, so K/V are never repeated. (4-D inputs keep SDPA on its fused CPU kernel.)
    query = (
        q.view(n, num_kv_heads, group, head_dim)
        .permute(1, 2, 0, 3)
        .reshape(1, num_kv_heads, group * n, head_dim)
    )
    # A chunk after cached context. The tail of the last block lies beyond every query's
    # position and is masked out below.
    keys, values = _context_keys(k_cache, v_cache, seq, block_size)
    total = keys.shape[1]
    if seq.mask is None:
        # Query i (at position num_context + i) sees keys 0 .. num_context + i.
        q_pos = torch.arange(n, device=q.device).repeat(group) + seq.num_context
        seq.mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]
    attn = F.scaled_dot_product_attention(
        query, keys[None], values[None], attn_mask=seq.mask[None, None], scale=scale
    )
    return (
        attn.view(num_kv_heads, group, n, head_dim)
        .permute(2, 0, 1, 3)
        .reshape(n, num_heads * head_dim)
    )
