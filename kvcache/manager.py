"""Per-request block tables over a shared BlockPool, with prefix caching.

The scheduler asks `get_computed_blocks` for the cached prefix of a new request, then
`allocate_slots` for room to compute its next tokens. `allocate_slots` returns None when
the pool is out of blocks: back-pressure is a value, and the scheduler answers it by
preempting.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvcache.block_pool import BlockPool
from kvcache.prefix import NONE_HASH, hash_full_blocks


class KVRequest(Protocol):
    """What the KV manager needs to know of a request."""

    request_id: str
    cache_salt: str | None
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters in tokens, cumulative since start."""

    num_query_tokens: int = 0  # prompt tokens looked up at admission
    num_hit_tokens: int = 0  # of those, tokens served from the cache


class KVCacheManager:
    """Hands out KV blocks to requests and shares full blocks through prefix hashes."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a running request."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[int], int]:
        """Cached blocks matching the request's longest full-block prefix, and their tokens.

        Only blocks inside the first `len(tokens) - 1` tokens count: the last prompt token
        is always recomputed, so its logits exist. Takes no reference.
        """
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return [], 0
        tokens = request.all_token_ids
        bs = self.block_size
        max_blocks = (len(tokens) - 1) // bs
        hashes = self._block_hashes(request, max_blocks * bs)
        hits: list[int] = []
        parent = NONE_HASH
        for i in range(max_blocks):
            block_id = self.pool.lookup(hashes[i], parent, tokens[i * bs : (i + 1) * bs])
            if block_id is None:
                break
            hits.append(block_id)
            parent = hashes[i]
        return hits, len(hits) * bs

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of KV; returns the new blocks.

        `computed_blocks` are prefix-cache hits from `get_computed_blocks` (new requests
        only); they are referenced on success. `num_lookahead_tokens`: room for that many
        tokens after these too, taken now (a prompt's later chunks, in one run of blocks).
        Returns None, changing nothing, when the pool cannot supply the blocks.
        """
        table = self._tables.get(request.request_id)
        is_new = table is None
        if table is None:
            table = []
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_tokens += num_lookahead_tokens
        num_needed = self.num_blocks_for(num_tokens + num_new_tokens) - len(table)
        num_needed -= len(computed_blocks)
        # A hit on a free cached block takes that block off the free list.
        num_hits_free = sum(1 for b in computed_blocks if self.pool.is_free(b))
        if num_needed > self.pool.num_free_blocks - num_hits_free:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0)) or []
        table.extend(computed_blocks)
        table.extend(new_blocks)
        if is_new:
            self._tables[request.request_id] = table
            if self.enable_prefix_caching:
                self.stats.num_query_tokens += len(request.all_token_ids)
                self.stats.num_hit_tokens += len(computed_blocks) * self.block_size
                self._num_registered[request.request_id] = len(computed_blocks)
        return new_blocks

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        """Register the request's blocks that are now full of computed KV."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(table))
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        tokens = request.all_token_ids
        hashes = self._block_hashes(request, num_full * bs)
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else NONE_HASH
            self.pool.cache(table[i], hashes[i], parent, tokens[i * bs : (i + 1) * bs])
        self._num_registered[rid] = num_full

    def free(self, request_id: str) -> None:
        """Release every block of the request (cached ones stay findable until reused)."""
        table = self._tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if table:
            self.pool.free(table)

    def _block_hashes(self, request: KVRequest, num_tokens: int) -> list[bytes]:
        known = self._hashes.setdefault(request.request_id, [])
        if len(known) * self.block_size < num_tokens:
            tokens = request.all_token_ids[:num_tokens]
            hash_full_blocks(tokens, self.block_size, request.cache_salt, known)
        return known
