"""Scheduler: policy functions, batch packing, chunked prefill and preemption (no torch)."""

import random
import subprocess
import sys

import pytest

from tests.unit.workers.scheduler_factories import (
    REPO_ROOT,
    make_request,
    make_requests,
    make_scheduler,
    run_to_completion,
    scheduled_ids,
    step,
)
from workers.engine.request import FinishReason, RequestStatus
from workers.engine.scheduler import (
    chunk_cost,
    effective_priority,
    pick_victim,
    prefill_chunk,
)

# -- pure policy functions --------------------------------------------------------------


def test_scheduler_modules_import_without_torch() -> None:
    code = (
        "import sys, kvcache, workers.engine.scheduler, workers.engine.config, "
        "workers.engine.request, "
        "workers.engine.sampling_params; assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("remaining", "budget", "cap", "chunked", "expected"),
    [
        (100, 32, None, True, 32),
        (100, 32, 8, True, 8),
        (5, 32, 8, True, 5),
        (100, 32, 8, False, 0),
        (32, 32, 8, False, 32),
        (1, 1, None, True, 1),
    ],
)
def test_prefill_chunk_respects_budget_cap_and_chunking(
    remaining: int, budget: int, cap: int | None, chunked: bool, expected: int
) -> None:
    assert prefill_chunk(remaining, budget, cap, chunked) == expected


def test_context_shortens_a_chunk_but_never_below_one_token() -> None:
    assert prefill_chunk(100, 32, None, True, context=96, parity=32) == 8
    assert chunk_cost(8, 96, 32) == 32
    assert chunk_cost(7, 96, 32) == 28
    assert chunk_cost(5, 3, 32) == 6  # rounded up: 5 * 35 / 32 = 5.47
    assert prefill_chunk(100, 2, None, True, context=1000, parity=10) == 1
    assert prefill_chunk(100, 32, 4, True, context=96, parity=32) == 4  # the cap still holds
    # No parity, no context or no chunking: tokens only.
    assert prefill_chunk(100, 32, None, True, context=96, parity=None) == 32
    assert prefill_chunk(100, 32, None, True, context=0, parity=32) == 32
    assert chunk_cost(8, 96, None) == 8 and chunk_cost(8, 0, 32) == 8
    assert prefill_chunk(32, 32, None, False, context=96, parity=32) == 32


def test_effective_priority_improves_one_level_per_aging_steps() -> None:
    req = make_request("a", priority=5)
    req.arrival_step = 10
    assert effective_priority(req, 10, 4) == 5
    assert effective_priority(req, 13, 4) == 5
    assert effective_priority(req, 14, 4) == 4
    assert effective_priority(req, 30, 4) == 0
    assert effective_priority(req, 12, 0) == 3  # aging_steps 0 is treated as 1


def test_pick_victim_prefers_lowest_priority_then_least_computed_then_newest() -> None:
    high = make_request("high", priority=0, arrival_time=5.0)
    low_busy = make_request("low_busy", priority=3, arrival_time=1.0)
    low_busy.num_computed_tokens = 40
    low_idle_old = make_request("low_idle_old", priority=3, arrival_time=1.0)
    low_idle_old.num_computed_tokens = 8
    low_idle_new = make_request("low_idle_new", priority=3, arrival_time=2.0)
    low_idle_new.num_computed_tokens = 8

    assert pick_victim([high, low_busy]) is low_busy
    assert pick_victim([high, low_busy, low_idle_old]) is low_idle_old
    assert pick_victim([low_idle_new, high, low_busy, low_idle_old]) is low_idle_new


# -- batch packing ----------------------------------------------------------------------


def test_add_rejects_duplicate_request_ids() -> None:
    sched = make_scheduler()
    sched.add(make_request("a"))
    with pytest.raises(ValueError):
        sched.add(make_request("a"))
    assert sched.num_waiting == 1


def test_decodes_are_packed_before_prefill_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, max_prefill_chunk=8)
    long = make_request("long", 40, max_tokens=2)
    short = make_request("short", 4, max_tokens=8)
    sched.add(long)
    sched.add(short)
    first = step(sched)
    assert scheduled_ids(first) == ["long", "short"]

    sched.add(make_request("new", 8))
    out = step(sched)

    # `long` is older in the running batch, yet the decode of `short` goes first.
    assert out.scheduled[0] == (short, 1)
    assert [(r.request_id, n) for r, n in out.scheduled[1:]] == [("long", 8), ("new", 7)]


def test_token_budget_is_never_exceeded_and_is_filled() -> None:
    rng = random.Random(0)
    sched = make_scheduler(max_num_batched_tokens=24, max_num_seqs=8)
    for i in range(30):
        sched.add(make_request(f"r{i}", rng.randint(1, 60), max_tokens=rng.randint(1, 6)))
    outs = run_to_completion(sched)
    totals = [o.num_scheduled_tokens for o in outs]
    assert max(totals) == 24  # check_invariants asserted <= 24 on every step


def test_max_prefill_chunk_caps_each_step_of_a_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, max_prefill_chunk=8)
    req = make_request("a", 30, max_tokens=1)
    sched.add(req)
    chunks = []
    while sched.has_unfinished():
        out = step(sched)
        chunks.extend(n for r, n in out.scheduled if r is req)
    assert chunks == [8, 8, 8, 6]


def test_max_num_seqs_bounds_the_running_batch() -> None:
    sched = make_scheduler(max_num_seqs=3)
    for req in make_requests(10, 4, max_tokens=3):
        sched.add(req)
    first = step(sched)
    assert len(first.scheduled) == 3
    assert sched.num_running == 3 and sched.num_waiting == 7
    outs = run_to_completion(sched)
    assert max(len(o.scheduled) for o in outs) == 3


def test_chunked_prefill_progresses_while_decodes_run_every_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    decoders = make_requests(2, 4, prefix="d", max_tokens=20)
    for req in decoders:
        sched.add(req)
    step(sched)
    long = make_request("long", 40, max_tokens=1)
    sched.add(long)

    chunks = []
    while not long.is_finished:
        out = step(sched)
        assert [(r.request_id, n) for r, n in out.scheduled[:2]] == [("d0", 1), ("d1", 1)]
        chunks.extend(n for r, n in out.scheduled if r is long)
    assert chunks == [8] * 5
    assert all(d.num_output_tokens == 6 for d in decoders)


def _chunks_of(sched, req) -> list[int]:
    chunks = []
    while not req.is_finished:
        chunks.extend(n for r, n in step(sched).scheduled if r is req)
    return chunks


def test_a_chunk_after_cached_context_pays_for_its_attention_over_it() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, attention_parity_context=32)
    long = make_request("long", 200, max_tokens=1)
    sched.add(long)
    chunks = _chunks_of(sched, long)

    # The first chunk has no context; each later one is what 1 + context / 32 per token
    # lets into 64: after 64 tokens, 64 * 32 // 96 = 21; after 85, 64 * 32 // 117 = 17.
    assert chunks[:3] == [64, 21, 17]
    assert sum(chunks) == 200
    context = 0
    for n in chunks:
        assert chunk_cost(n, context, 32) <= 64
        context += n
    assert chunks == sorted(chunks, reverse=True)

    tokens_only = make_scheduler(max_num_batched_tokens=64, attention_parity_context=0)
    long = make_request("long", 200, max_tokens=1)
    tokens_only.add(long)
    assert _chunks_of(tokens_only, long) == [64, 64, 64, 8]


def test_a_decode_takes_one_token_of_budget_whatever_its_context() -> None:
    sched = make_scheduler(max_num_batched_tokens=10, attention_parity_context=4)
    decoders = make_requests(2, 4, prefix="d", max_tokens=20)
    for req in decoders:
        sched.add(req)
    for _ in range(12):
        step(sched)
    assert all(d.num_computed_tokens == 15 for d in decoders)
    new = make_request("new", 8, max_tokens=1)
    sched.add(new)
    out = step(sched)
    # Charged 1 + 15 / 4 each, the decodes would have left 0 for `new`, not 8.
    assert [(r.request_id, n) for r, n in out.scheduled] == [("d0", 1), ("d1", 1), ("new", 8)]


def test_a_prefix_hit_is_admitted_at_the_cost_of_its_context() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, attention_parity_context=32)
    shared = list(range(1000, 1032))  # 8 full blocks of 4
    first = make_request("first", prompt=shared + [1, 2, 3, 4])
    sched.add(first)
    run_to_completion(sched)

    hit = make_request("hit", prompt=shared + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])
    fresh = make_request("fresh", 40)
    sched.add(hit)
    sched.add(fresh)
    out = step(sched)
    # `hit` computes its 12 new tokens after 32 cached ones: 12 * (32 + 32) / 32 = 24 of
    # the budget, so `fresh` gets the other 40.
    assert hit.num_cached_tokens == 32
    assert [(r.request_id, n) for r, n in out.scheduled] == [("hit", 12), ("fresh", 40)]


def test_a_chunked_prompt_takes_all_its_blocks_with_its_first_chunk_as_one_run() -> None:
    sched = make_scheduler(max_num_batched_tokens=10, num_blocks=64)
    decoders = make_requests(2, 4, prefix="d", max_tokens=40)
    for req in decoders:
        sched.add(req)
    step(sched)
    long = make_request("long", 40, max_tokens=1)
    sched.add(long)
    step(sched)
    assert long.num_computed_tokens == 8
    table = sched.kv.block_table("long")
    assert table == list(range(table[0], table[0] + 10))  # all 40 tokens, neighbours
    while not long.is_finished:  # the decoders grow into new blocks meanwhile
        step(sched)
        assert sched.kv.block_table("long")[:10] == table or long.is_finished


def test_a_chunked_prompt_whose_blocks_do_not_all_fit_waits_rather_than_starting() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, num_blocks=8)
    holder = make_request("holder", 16, max_tokens=20)  # 4 blocks, then a 5th
    sched.add(holder)
    step(sched)
    step(sched)
    assert holder.num_output_tokens == 1 and sched.kv.num_free_blocks == 4
    long = make_request("long", 20, max_tokens=1)  # 5 blocks: one more than is free
    sched.add(long)
    out = step(sched)
    assert scheduled_ids(out) == ["holder"] and long.num_computed_tokens == 0
    assert sched.kv.block_table("long") == [] and sched.num_waiting == 1


def test_without_chunked_prefill_a_prompt_larger_than_the_remaining_budget_waits() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    decoder = make_request("d", 4, max_tokens=3)
    sched.add(decoder)
    step(sched)
    prompt = make_request("p", 16, max_tokens=1)
    sched.add(prompt)

    out = step(sched)
    assert out.scheduled == [(decoder, 1)]  # 15 tokens left: not enough for 16
    assert prompt.status is RequestStatus.WAITING and prompt.num_computed_tokens == 0

    step(sched)  # the decoder's last token
    out = step(sched)
    assert out.scheduled == [(prompt, 16)]


def test_without_chunked_prefill_a_resumed_request_longer_than_a_step_is_chunked() -> None:
    # `b` is preempted with 20+ tokens, more than one 16-token step can recompute at once.
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=16, enable_chunked_prefill=False)
    a = make_request("a", 8, max_tokens=30, priority=0)
    b = make_request("b", 8, max_tokens=30, priority=1)
    sched.add(a)
    sched.add(b)

    run_to_completion(sched, max_steps=200)

    assert b.num_preemptions == 1
    assert b.finish_reason is FinishReason.LENGTH and b.num_output_tokens == 30
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


# -- preemption -------------------------------------------------------------------------


def test_preemption_evicts_the_lowest_priority_request_to_the_head_of_waiting() -> None:
    # Three 8-token prompts fill the 6-block pool; the first decode needs a seventh block.
    sched = make_scheduler(num_blocks=6)
    a = make_request("a", 8, max_tokens=4, priority=0)
    b = make_request("b", 8, max_tokens=4, priority=1)
    c = make_request("c", 7, max_tokens=4, priority=0)
    for req in (a, b, c):
        sched.add(req)
    step(sched)
    queued = make_request("queued", 4)
    sched.add(queued)

    out = step(sched)

    assert out.preempted == [b]
    assert sched.waiting[0] is b and sched.waiting[1] is queued
    assert b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.kv.block_table("b") == []
    assert b not in sched.running
    assert scheduled_ids(out) == ["a", "c"]
    assert sched.num_preemptions == 1


def test_preemption_among_equal_priorities_evicts_the_least_computed() -> None:
    sched = make_scheduler(num_blocks=5)
    big = make_request("big", 12, max_tokens=4)
    small = make_request("small", 8, max_tokens=4)
    sched.add(big)
    sched.add(small)
    step(sched)

    out = step(sched)  # `big` needs a fourth block for token 13

    assert out.preempted == [small]
    assert small.num_computed_tokens == 0 and small.num_preemptions == 1
    assert out.scheduled == [(big, 1)]


def test_preempting_an_already_scheduled_victim_returns_its_tokens_to_the_budget() -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=4)
    low = make_request("low", 1, max_tokens=12, priority=1)
    sched.add(low)
    step(sched)
    grower = make_request("grower", 3, max_tokens=12)
    long = make_request("long", 5, max_tokens=12)
    sched.add(grower)
    sched.add(long)
    step(sched)
    step(sched)  # `long` takes its first 2 tokens, and the blocks of all 5
    assert sched.kv.num_free_blocks == 0
    assert long.num_computed_tokens == 2 and len(sched.kv.block_table("long")) == 2

    # `low` decodes first, then `grower` needs a block and preempts it: low's token goes
    # back to the budget, so `long` gets 3 tokens, not 2.
    out = step(sched)

    assert out.preempted == [low]
    assert out.scheduled == [(grower, 1), (long, 3)]
    assert out.num_scheduled_tokens == 4


def test_a_request_that_is_itself_the_victim_is_not_scheduled() -> None:
    sched = make_scheduler(num_blocks=4)
    keep = make_request("keep", 7, max_tokens=4, priority=0)
    victim = make_request("victim", 8, max_tokens=4, priority=2)
    sched.add(keep)
    sched.add(victim)
    step(sched)

    out = step(sched)  # `victim` needs a third block for token 9; none is free

    assert out.preempted == [victim]
    assert out.scheduled == [(keep, 1)]


@pytest.mark.parametrize("seed", range(6))
def test_all_requests_finish_with_a_pool_too_small_for_the_batch(seed: int) -> None:
    rng = random.Random(seed)
    # 12 blocks hold at most 48 tokens; the batch needs up to 10 * 24 at once.
    sched = make_scheduler(num_blocks=12, max_num_batched_tokens=32, max_num_seqs=10)
    requests = [
        make_request(
            f"r{i}",
            rng.randint(6, 16),
            max_tokens=rng.randint(4, 8),
            priority=rng.randint(0, 2),
            arrival_time=float(i),
        )
        for i in range(10)
    ]
    for req in requests:
        sched.add(req)

    run_to_completion(sched)

    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)
    assert all(r.num_output_tokens == r.params.max_tokens for r in requests)
    assert sched.num_preemptions > 0
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks
    assert sched.requests == {}


def test_pool_is_entirely_free_after_everything_finishes() -> None:
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=32)
    for req in make_requests(12, 13, max_tokens=5):
        sched.add(req)
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks
    assert sched.kv.usage == 0.0
