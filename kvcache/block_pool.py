"""A pool of fixed-size KV blocks with reference counts and an LRU free list.

Free blocks that still hold a cached prefix stay findable by hash until they are
reused; the free list is kept in eviction order (front = evicted first).
"""

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class BlockPool:
    """Block ids `0 .. num_blocks-1`, each with a ref count and an optional prefix hash.

    Invariant: every block is either free (ref count 0, on the free list) or used
    (ref count > 0); `num_free_blocks + num_used_blocks == num_blocks`.
    """

    __slots__ = ("num_blocks", "block_size", "_ref", "_hash", "_tokens", "_free", "_cached")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        # Tokens of a cached block with its parent hash: checked on every hit, so a hash
        # collision can never serve another prompt's KV.
        self._tokens: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take the first `num_blocks` blocks off the free list (evicting their cached
        prefix); returned in ascending id order.

        Returns None, and changes nothing, when fewer blocks are free.
        """
        if num_blocks > len(self._free):
            return None
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref[block_id] = 1
            out.append(block_id)
        # In ascending order: a run of neighbouring blocks (a fresh pool's, or one freed
        # tail first) comes back in cache order, so attention can read it as one view.
        out.sort()
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit)."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free list.

        Blocks are released tail first, so a request's last blocks (the least likely
        to be shared) are evicted before its first ones.
        """
        for block_id in reversed(block_ids):
            ref = self._ref[block_id]
            if ref <= 0:
                raise RuntimeError(f"block {block_id} freed with ref count {ref}")
            self._ref[block_id] = ref - 1
            if ref == 1:
                self._free[block_id] = None

    def lookup(self, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly these tokens after this parent, or None."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        if self._tokens[block_id] != (parent_hash, tuple(token_ids)):
            return None
        return block_id

    def cache(
        self, block_id: int, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int]
    ) -> None:
        """Register a full, used block under its prefix hash (first writer wins)."""
        if self._hash[block_id] is not None or block_hash in self._cached:
            return
        self._hash[block_id] = block_hash
        self._tokens[block_id] = (parent_hash, tuple(token_ids))
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their data)."""
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        self._tokens = [None] * self.num_blocks

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash[block_id]
        if block_hash is not None:
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]
            self._hash[block_id] = None
            self._tokens[block_id] = None
