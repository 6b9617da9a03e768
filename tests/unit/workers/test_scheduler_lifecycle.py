"""Scheduler: abort, deadlines, fairness and prefix-cache admission (no torch)."""

from tests.unit.workers.scheduler_factories import (
    make_clock,
    make_request,
    make_requests,
    make_scheduler,
    run_to_completion,
    scheduled_ids,
    step,
)
from workers.engine.request import FinishReason, RequestStatus

# -- abort ------------------------------------------------------------------------------


def test_abort_of_a_waiting_request_removes_it_before_it_runs() -> None:
    sched = make_scheduler(max_num_seqs=1)
    running, waiting = make_requests(2, 4, max_tokens=3)
    sched.add(running)
    sched.add(waiting)
    step(sched)

    assert sched.abort(waiting.request_id) is waiting

    assert waiting.finish_reason is FinishReason.ABORT and waiting.is_finished
    assert waiting not in sched.waiting
    outs = run_to_completion(sched)
    assert all(waiting.request_id not in scheduled_ids(o) for o in outs)
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_abort_mid_prefill_frees_its_blocks_immediately() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    req = make_request("a", 30)
    sched.add(req)
    step(sched)
    assert 0 < req.num_computed_tokens < req.num_prompt_tokens
    assert sched.kv.num_free_blocks < sched.kv.num_total_blocks

    sched.abort("a")

    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks
    assert req.finish_reason is FinishReason.ABORT
    assert not sched.has_unfinished()


def test_abort_while_decoding_frees_its_blocks_immediately() -> None:
    sched = make_scheduler()
    req = make_request("a", 9, max_tokens=10)
    sched.add(req)
    step(sched)
    step(sched)
    assert req.num_output_tokens == 2

    sched.abort("a")

    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks
    assert req not in sched.running
    assert sched.schedule().scheduled == []


def test_abort_of_a_preempted_request_leaves_only_the_others_blocks_used() -> None:
    sched = make_scheduler(num_blocks=4)
    keep = make_request("keep", 7, max_tokens=4, priority=0)
    victim = make_request("victim", 8, max_tokens=4, priority=2)
    sched.add(keep)
    sched.add(victim)
    step(sched)
    step(sched)
    assert victim.num_preemptions == 1 and victim in sched.waiting

    sched.abort("victim")

    assert victim not in sched.waiting
    assert victim.finish_reason is FinishReason.ABORT
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks - len(sched.kv.block_table("keep"))
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_abort_of_an_unknown_or_finished_request_returns_none() -> None:
    sched = make_scheduler()
    req = make_request("a", 4, max_tokens=1)
    sched.add(req)
    run_to_completion(sched)
    assert sched.abort("a") is None
    assert sched.abort("nobody") is None
    assert req.finish_reason is FinishReason.LENGTH


# -- deadlines --------------------------------------------------------------------------


def test_request_past_its_deadline_is_expired_at_dequeue_and_never_scheduled() -> None:
    clock, set_now = make_clock(0.0)
    sched = make_scheduler(clock=clock, max_num_seqs=1)
    blocker = make_request("blocker", 4, max_tokens=5)
    late = make_request("late", 4, deadline=2.0)
    sched.add(blocker)
    sched.add(late)

    outs = [step(sched)]
    set_now(2.0)  # not yet past: `now > deadline` expires
    outs.append(step(sched))
    assert late.status is RequestStatus.WAITING
    set_now(3.0)
    expired_out = step(sched)
    outs.append(expired_out)
    outs.extend(run_to_completion(sched))

    assert expired_out.expired == [late]
    assert late.finish_reason is FinishReason.DEADLINE
    assert late.num_computed_tokens == 0 and late.first_scheduled_time is None
    assert all("late" not in scheduled_ids(o) for o in outs)
    assert sum(len(o.expired) for o in outs) == 1
    assert blocker.finish_reason is FinishReason.LENGTH


def test_expiry_does_not_block_admission_of_the_next_request() -> None:
    clock, set_now = make_clock(10.0)
    sched = make_scheduler(clock=clock)
    late = make_request("late", 4, deadline=5.0)
    ok = make_request("ok", 4, deadline=50.0)
    sched.add(late)
    sched.add(ok)

    out = step(sched)

    assert out.expired == [late]
    assert out.scheduled == [(ok, 4)]
    assert ok.first_scheduled_time == 10.0


def test_preempted_request_past_its_deadline_is_resumed_not_expired() -> None:
    clock, set_now = make_clock(0.0)
    sched = make_scheduler(clock=clock, num_blocks=4)
    keep = make_request("keep", 7, max_tokens=4, priority=0)
    victim = make_request("victim", 8, max_tokens=4, priority=2, deadline=1.0)
    sched.add(keep)
    sched.add(victim)
    step(sched)  # both prefilled; `victim` has streamed a token
    step(sched)
    assert victim.num_preemptions == 1
    set_now(5.0)

    outs = run_to_completion(sched)

    assert all(o.expired == [] for o in outs)
    assert victim.finish_reason is FinishReason.LENGTH
    assert victim.num_output_tokens == 4


# -- fairness ---------------------------------------------------------------------------


def test_low_priority_request_is_admitted_within_bounded_steps_under_a_steady_stream() -> None:
    aging_steps, slack = 4, 3
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, aging_steps=aging_steps)
    low = make_request("low", 4, max_tokens=1, priority=5)
    sched.add(low)

    admitted_at = None
    for step_no in range(1, aging_steps * 5 + slack + 1):
        # Four new one-step requests a step fill all four sequence slots on their own.
        for i in range(4):
            sched.add(make_request(f"s{step_no}-{i}", 4, max_tokens=1, priority=0))
        out = step(sched)
        assert len(out.scheduled) == 4
        if low in (r for r, _ in out.scheduled):
            admitted_at = step_no
            break

    assert admitted_at is not None, "low-priority request starved"
    assert admitted_at > aging_steps  # newer priority-0 work did go first for a while
    assert admitted_at <= aging_steps * 5 + slack


# -- prefix cache -----------------------------------------------------------------------


def test_prefix_cache_hit_at_admission_skips_the_cached_tokens() -> None:
    sched = make_scheduler()
    prompt = list(range(100, 113))  # 13 tokens: three full blocks and one more
    first = make_request("first", prompt=prompt, max_tokens=2)
    sched.add(first)
    run_to_completion(sched)
    assert first.num_cached_tokens == 0

    second = make_request("second", prompt=prompt[:12] + [7, 7, 7], max_tokens=2)
    sched.add(second)
    out = sched.schedule()

    assert out.scheduled == [(second, 3)]
    assert second.num_computed_tokens == 12
    assert second.num_cached_tokens == 12
    assert sched.kv.stats.num_hit_tokens == 12
    sched.advance(out)
    assert second.num_computed_tokens == second.num_tokens


def test_resumed_request_reuses_its_cached_prefix_but_keeps_its_first_cache_count() -> None:
    sched = make_scheduler(num_blocks=4)
    keep = make_request("keep", 7, max_tokens=4, priority=0)
    victim = make_request("victim", 8, max_tokens=4, priority=2)
    sched.add(keep)
    sched.add(victim)
    step(sched)
    step(sched)
    assert victim.num_preemptions == 1 and victim.num_cached_tokens == 0

    resumed = []
    while sched.has_unfinished():
        out = step(sched)
        resumed.extend(n for r, n in out.scheduled if r is victim and n > 1)

    # Its tail block was evicted first; the head block survived and is reused.
    assert resumed == [victim.num_prompt_tokens + 1 - 4]
    assert victim.num_cached_tokens == 0
    assert victim.finish_reason is FinishReason.LENGTH


def test_prefix_cache_off_computes_the_whole_prompt() -> None:
    sched = make_scheduler(enable_prefix_caching=False)
    prompt = list(range(100, 113))
    sched.add(make_request("first", prompt=prompt, max_tokens=1))
    run_to_completion(sched)
    second = make_request("second", prompt=prompt, max_tokens=1)
    sched.add(second)
    out = sched.schedule()
    assert out.scheduled == [(second, 13)]
    assert second.num_cached_tokens == 0
