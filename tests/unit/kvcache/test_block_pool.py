"""BlockPool: allocation back-pressure, ref counts, the LRU free list and cached blocks."""

import random

import pytest

from kvcache import NONE_HASH, BlockPool, hash_block


def make_pool(num_blocks: int = 8, block_size: int = 4) -> BlockPool:
    return BlockPool(num_blocks, block_size)


def cache_block(pool: BlockPool, block_id: int, tokens: list[int]) -> bytes:
    """Register `block_id` as the first block of a prompt starting with `tokens`."""
    block_hash = hash_block(NONE_HASH, tokens)
    pool.cache(block_id, block_hash, NONE_HASH, tokens)
    return block_hash


def free_list(pool: BlockPool) -> list[int]:
    """The free blocks in eviction order, observed by allocating them one at a time."""
    order = []
    while pool.num_free_blocks:
        got = pool.allocate(1)
        assert got is not None
        order += got
    return order


def test_allocate_returns_distinct_blocks_with_ref_count_one() -> None:
    pool = make_pool(8)
    blocks = pool.allocate(3)
    assert blocks is not None and len(set(blocks)) == 3
    assert all(pool.ref_count(b) == 1 and not pool.is_free(b) for b in blocks)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (5, 3)


def test_a_run_freed_tail_first_comes_back_in_ascending_order() -> None:
    pool = make_pool(8)
    run = pool.allocate(4)
    assert run == [0, 1, 2, 3]  # a fresh pool hands out neighbours
    pool.allocate(4)
    pool.free(run)  # tail first: the free list holds 3, 2, 1, 0
    assert pool.allocate(4) == [0, 1, 2, 3]


def test_allocate_more_than_free_returns_none_and_changes_nothing() -> None:
    pool = make_pool(4)
    held = pool.allocate(2)
    assert held is not None
    block_hash = hash_block(NONE_HASH, [1, 2, 3, 4])
    pool.cache(held[0], block_hash, NONE_HASH, [1, 2, 3, 4])
    pool.free([held[0]])

    assert pool.allocate(4) is None

    assert (pool.num_free_blocks, pool.num_used_blocks) == (3, 1)
    assert pool.lookup(block_hash, NONE_HASH, [1, 2, 3, 4]) == held[0]
    assert pool.allocate(3) is not None


def test_allocate_zero_blocks_returns_empty_list() -> None:
    pool = make_pool(2)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_pool_rejects_empty_shapes() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


@pytest.mark.parametrize("seed", range(5))
def test_free_plus_used_equals_total_after_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    pool = make_pool(num_blocks=16)
    held: list[int] = []  # one entry per reference we own
    for _ in range(500):
        op = rng.choice(["allocate", "free", "touch", "cache"])
        if op == "allocate":
            n = rng.randint(0, 6)
            got = pool.allocate(n)
            if got is None:
                assert n > pool.num_free_blocks
            else:
                held.extend(got)
        elif op == "free" and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            pool.free(held[:k])
            del held[:k]
        elif op == "touch":
            # A prefix hit may reference a used block or a free one.
            block_id = rng.randrange(pool.num_blocks)
            pool.touch([block_id])
            held.append(block_id)
        elif op == "cache" and held:
            block_id = rng.choice(held)
            tokens = [rng.randrange(50) for _ in range(pool.block_size)]
            pool.cache(block_id, hash_block(NONE_HASH, tokens), NONE_HASH, tokens)

        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        for block_id in range(pool.num_blocks):
            refs = held.count(block_id)
            assert pool.ref_count(block_id) == refs >= 0
            assert pool.is_free(block_id) == (refs == 0)

    pool.free(held)
    assert pool.num_free_blocks == pool.num_blocks


def test_freeing_a_free_block_raises() -> None:
    pool = make_pool(4)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free(blocks)
    assert pool.ref_count(blocks[0]) == 0
    assert pool.num_free_blocks == 4


def test_freeing_a_never_allocated_block_raises() -> None:
    pool = make_pool(4)
    with pytest.raises(RuntimeError):
        pool.free([2])
    assert pool.ref_count(2) == 0


def test_shared_block_stays_off_free_list_while_referenced() -> None:
    pool = make_pool(4)
    blocks = pool.allocate(1)
    assert blocks is not None
    (shared,) = blocks
    pool.touch([shared])
    assert pool.ref_count(shared) == 2

    pool.free([shared])
    assert pool.ref_count(shared) == 1
    assert not pool.is_free(shared)
    others = pool.allocate(3)
    assert others is not None and shared not in others
    assert pool.allocate(1) is None

    pool.free([shared])
    assert pool.is_free(shared)
    assert pool.allocate(1) == [shared]


def test_free_puts_tail_blocks_first_in_eviction_order() -> None:
    pool = make_pool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    a, b, c = blocks
    pool.free([a, b, c])
    assert free_list(pool) == [c, b, a]


def test_earlier_freed_blocks_are_evicted_first() -> None:
    pool = make_pool(4)
    blocks = pool.allocate(4)
    assert blocks is not None
    first, second = blocks[:2], blocks[2:]
    pool.free(second)
    pool.free(first)
    assert free_list(pool) == second[::-1] + first[::-1]


def test_touching_a_free_block_removes_it_from_the_free_list() -> None:
    pool = make_pool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.free(blocks)
    pool.touch([blocks[1]])
    assert pool.ref_count(blocks[1]) == 1
    assert pool.num_free_blocks == 2
    assert blocks[1] not in free_list(pool)


def test_cached_block_stays_findable_while_free_until_reallocated() -> None:
    pool = make_pool(2)
    blocks = pool.allocate(2)
    assert blocks is not None
    cached, other = blocks
    tokens = [5, 6, 7, 8]
    block_hash = cache_block(pool, cached, tokens)
    # Freed last, the cached block sits behind `other` in eviction order.
    pool.free([other])
    pool.free([cached])

    assert pool.lookup(block_hash, NONE_HASH, tokens) == cached
    assert pool.allocate(1) == [other]
    assert pool.lookup(block_hash, NONE_HASH, tokens) == cached
    assert pool.num_cached_blocks == 1

    assert pool.allocate(1) == [cached]
    assert pool.lookup(block_hash, NONE_HASH, tokens) is None
    assert pool.num_cached_blocks == 0


def test_lookup_rejects_a_forged_hash_with_different_tokens() -> None:
    pool = make_pool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    block_hash = cache_block(pool, blocks[0], [1, 2, 3, 4])
    assert pool.lookup(block_hash, NONE_HASH, [1, 2, 3, 9]) is None
    assert pool.lookup(block_hash, b"\x01" * 16, [1, 2, 3, 4]) is None
    assert pool.lookup(block_hash, NONE_HASH, [1, 2, 3, 4]) == blocks[0]


def test_cache_keeps_the_first_writer_of_a_hash() -> None:
    pool = make_pool(2)
    blocks = pool.allocate(2)
    assert blocks is not None
    first, second = blocks
    block_hash = cache_block(pool, first, [1, 2, 3, 4])
    cache_block(pool, second, [1, 2, 3, 4])
    assert pool.lookup(block_hash, NONE_HASH, [1, 2, 3, 4]) == first
    assert pool.num_cached_blocks == 1


def test_reusing_a_duplicate_block_keeps_the_cached_original_findable() -> None:
    pool = make_pool(2)
    blocks = pool.allocate(2)
    assert blocks is not None
    first, duplicate = blocks
    block_hash = cache_block(pool, first, [1, 2, 3, 4])
    cache_block(pool, duplicate, [1, 2, 3, 4])
    pool.free([duplicate])
    assert pool.allocate(1) == [duplicate]
    assert pool.lookup(block_hash, NONE_HASH, [1, 2, 3, 4]) == first


def test_reset_prefix_cache_forgets_every_hash_but_keeps_refs() -> None:
    pool = make_pool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    block_hash = cache_block(pool, blocks[0], [1, 2, 3, 4])
    pool.reset_prefix_cache()
    assert pool.lookup(block_hash, NONE_HASH, [1, 2, 3, 4]) is None
    assert pool.num_cached_blocks == 0
    assert pool.ref_count(blocks[0]) == 1
