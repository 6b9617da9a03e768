"""KVCacheManager: per-request block tables, prefix-cache hits and back-pressure."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kvcache import KVCacheManager

BLOCK_SIZE = 4


@dataclass
class FakeRequest:
    """The KVRequest protocol and nothing else."""

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    num_computed_tokens: int = 0


def make_kv(num_blocks: int = 16, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)


def make_request(
    request_id: str, num_tokens: int, *, start: int = 0, cache_salt: str | None = None
) -> FakeRequest:
    return FakeRequest(request_id, list(range(start, start + num_tokens)), cache_salt)


def prefill(kv: KVCacheManager, req: FakeRequest) -> tuple[Sequence[int], int]:
    """Admit and compute the whole prompt as the scheduler would; returns the cache hit."""
    hits, num_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, len(req.all_token_ids) - num_hit, hits)
    assert new is not None
    req.num_computed_tokens = len(req.all_token_ids)
    kv.cache_blocks(req, req.num_computed_tokens)
    return hits, num_hit


def test_empty_cache_has_no_hits() -> None:
    kv = make_kv()
    assert kv.get_computed_blocks(make_request("a", 20)) == ([], 0)


def test_allocate_slots_gives_enough_blocks_for_the_tokens() -> None:
    kv = make_kv()
    req = make_request("a", 10)
    new = kv.allocate_slots(req, 10)
    assert new is not None and len(new) == 3
    assert kv.block_table("a") == new
    assert kv.num_free_blocks == 13


def test_allocate_slots_grows_the_table_only_at_block_boundaries() -> None:
    kv = make_kv()
    req = make_request("a", 6)
    assert kv.allocate_slots(req, 6) is not None
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 1) == []  # token 7 fits in block 2
    req.num_computed_tokens = 8
    new = kv.allocate_slots(req, 1)  # token 9 needs block 3
    assert new is not None and len(new) == 1
    assert len(kv.block_table("a")) == 3


def test_lookahead_takes_the_later_chunks_blocks_now_in_one_run() -> None:
    kv = make_kv()
    other = make_request("other", 4)
    assert kv.allocate_slots(other, 4) == [0]
    req = make_request("a", 20)
    new = kv.allocate_slots(req, 6, num_lookahead_tokens=14)  # 6 now, 14 in later chunks
    assert new == [1, 2, 3, 4, 5]
    other.num_computed_tokens = 4
    assert kv.allocate_slots(other, 4) == [6]  # another request grows between the chunks
    for done in (6, 12):
        req.num_computed_tokens = done
        assert kv.allocate_slots(req, 6 if done == 6 else 8) == []  # already there
    assert kv.block_table("a") == [1, 2, 3, 4, 5]
    # All or nothing: a lookahead the pool cannot hold takes nothing.
    big = make_request("big", 60)
    assert kv.allocate_slots(big, 4, num_lookahead_tokens=56) is None
    assert kv.block_table("big") == [] and kv.num_free_blocks == 9


def test_prompt_of_exact_full_blocks_hits_all_but_the_last_block() -> None:
    kv = make_kv()
    prefill(kv, make_request("a", 3 * BLOCK_SIZE))
    hits, num_hit = kv.get_computed_blocks(make_request("b", 3 * BLOCK_SIZE))
    assert len(hits) == 2
    assert num_hit == 2 * BLOCK_SIZE
    assert hits == kv.block_table("a")[:2]


def test_prompt_one_past_full_blocks_hits_every_full_block() -> None:
    kv = make_kv()
    prefill(kv, make_request("a", 3 * BLOCK_SIZE + 1))
    hits, num_hit = kv.get_computed_blocks(make_request("b", 3 * BLOCK_SIZE + 1))
    assert hits == kv.block_table("a")[:3]
    assert num_hit == 3 * BLOCK_SIZE


def test_second_request_with_same_prefix_hits_and_is_counted() -> None:
    kv = make_kv()
    first = make_request("a", 10)
    prefill(kv, first)
    second = FakeRequest("b", first.all_token_ids[:8] + [99, 98, 97, 96, 95])

    hits, num_hit = prefill(kv, second)

    assert num_hit == 8
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2:] != kv.block_table("a")[2:]
    assert all(kv.pool.ref_count(b) == 2 for b in hits)
    assert kv.stats.num_query_tokens == 10 + 13
    assert kv.stats.num_hit_tokens == 8


def test_diverging_prefix_stops_the_hit_at_the_first_different_block() -> None:
    kv = make_kv()
    first = make_request("a", 13)
    prefill(kv, first)
    tokens = list(first.all_token_ids)
    tokens[5] = 1000  # inside block 1
    hits, num_hit = kv.get_computed_blocks(FakeRequest("b", tokens))
    assert hits == kv.block_table("a")[:1]
    assert num_hit == BLOCK_SIZE


def test_different_cache_salt_gets_no_hit() -> None:
    kv = make_kv()
    prefill(kv, make_request("a", 13, cache_salt="tenant-a"))
    assert kv.get_computed_blocks(make_request("b", 13, cache_salt="tenant-b")) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", 13)) == ([], 0)
    _, num_hit = kv.get_computed_blocks(make_request("d", 13, cache_salt="tenant-a"))
    assert num_hit == 12


def test_only_computed_full_blocks_are_cached() -> None:
    kv = make_kv()
    req = make_request("a", 13)
    assert kv.allocate_slots(req, 6) is not None
    req.num_computed_tokens = 6
    kv.cache_blocks(req, 6)
    _, num_hit = kv.get_computed_blocks(make_request("b", 13))
    assert num_hit == BLOCK_SIZE


def test_disabled_prefix_caching_never_hits_nor_counts() -> None:
    kv = make_kv(enable_prefix_caching=False)
    prefill(kv, make_request("a", 13))
    assert kv.get_computed_blocks(make_request("b", 13)) == ([], 0)
    assert kv.stats.num_query_tokens == 0
    assert kv.pool.num_cached_blocks == 0


def test_request_holding_blocks_gets_no_further_hits() -> None:
    kv = make_kv()
    prefill(kv, make_request("a", 13))
    assert kv.get_computed_blocks(make_request("a", 13)) == ([], 0)


def test_allocate_slots_out_of_blocks_returns_none_and_changes_nothing() -> None:
    kv = make_kv(num_blocks=4)
    holder = make_request("a", 8)
    prefill(kv, holder)
    stats_before = (kv.stats.num_query_tokens, kv.stats.num_hit_tokens)

    assert kv.allocate_slots(make_request("b", 9, start=100), 9) is None

    assert kv.num_free_blocks == 2
    assert kv.block_table("b") == []
    assert (kv.stats.num_query_tokens, kv.stats.num_hit_tokens) == stats_before
    assert kv.allocate_slots(make_request("b", 8, start=100), 8) is not None


def test_failed_growth_of_running_request_keeps_its_table() -> None:
    kv = make_kv(num_blocks=2)
    req = make_request("a", 8)
    prefill(kv, req)
    table = list(kv.block_table("a"))
    assert kv.allocate_slots(req, 1) is None
    assert kv.block_table("a") == table
    assert kv.num_free_blocks == 0


def test_free_returns_every_block_and_keeps_them_findable() -> None:
    kv = make_kv(num_blocks=8)
    first = make_request("a", 13)
    prefill(kv, first)
    shared = make_request("b", 13)
    prefill(kv, shared)
    assert kv.num_free_blocks == 8 - 4 - 1

    kv.free("a")
    kv.free("b")

    assert kv.num_free_blocks == kv.num_total_blocks
    assert kv.usage == 0.0
    assert kv.block_table("a") == []
    _, num_hit = kv.get_computed_blocks(make_request("c", 13))
    assert num_hit == 12


def test_freeing_an_unknown_request_is_a_no_op() -> None:
    kv = make_kv()
    kv.free("nobody")
    assert kv.num_free_blocks == kv.num_total_blocks


def test_hits_on_free_cached_blocks_count_against_available_blocks() -> None:
    kv = make_kv(num_blocks=6)
    prefill(kv, make_request("a", 13))  # caches blocks 0..2, holds 4 blocks
    kv.free("a")
    assert kv.num_free_blocks == 6

    # Three free blocks are hits; the other three are all that is left for new tokens.
    too_big = make_request("b", 12 + 3 * BLOCK_SIZE + 1)
    hits, num_hit = kv.get_computed_blocks(too_big)
    assert (len(hits), num_hit) == (3, 12)
    assert kv.allocate_slots(too_big, len(too_big.all_token_ids) - num_hit, hits) is None
    assert kv.num_free_blocks == 6
    assert kv.get_computed_blocks(too_big)[1] == 12  # the failed attempt evicted nothing

    fits = make_request("c", 12 + 3 * BLOCK_SIZE)
    hits, num_hit = kv.get_computed_blocks(fits)
    new = kv.allocate_slots(fits, len(fits.all_token_ids) - num_hit, hits)
    assert new is not None and len(new) == 3
    assert kv.block_table("c")[:3] == hits
    assert kv.num_free_blocks == 0


def test_hits_on_used_blocks_do_not_consume_free_blocks() -> None:
    kv = make_kv(num_blocks=6)
    prefill(kv, make_request("a", 13))  # 4 blocks in use, 2 free
    req = make_request("b", 12 + 2 * BLOCK_SIZE)
    hits, num_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, len(req.all_token_ids) - num_hit, hits)
    assert new is not None and len(new) == 2
    assert kv.num_free_blocks == 0
    assert [kv.pool.ref_count(b) for b in hits] == [2, 2, 2]


def test_usage_is_the_fraction_of_used_blocks() -> None:
    kv = make_kv(num_blocks=8)
    assert kv.allocate_slots(make_request("a", 16), 16) is not None
    assert kv.usage == 0.5


@pytest.mark.parametrize(("num_tokens", "num_blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (16, 4)])
def test_num_blocks_for_rounds_up(num_tokens: int, num_blocks: int) -> None:
    assert make_kv().num_blocks_for(num_tokens) == num_blocks
