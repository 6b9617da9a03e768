"""Admission predicts a request's first token from measured signals and refuses what would
miss its TTFT target: pure functions of the replicas' seats, step times, prefill rates,
the work queued ahead in tokens, and replicas still starting."""

import asyncio
import math

import pytest

from gateway.capacity.balancer import WorkerView
from gateway.capacity.fair_queue import QueueConfig, Ticket
from gateway.capacity.lease import Lease
from gateway.capacity.pool import Pool
from gateway.capacity.predictor import ReplicaCapacity, Work, predict, retry_after_s
from gateway.capacity.refusals import OverCapacity


def replica(seats: int = 4, occupied: tuple[float, ...] = (), **kw: float) -> ReplicaCapacity:
    kw.setdefault("decode_step_s", 0.05)
    kw.setdefault("prefill_tokens_per_s", 1000.0)
    return ReplicaCapacity(seats, occupied, **kw)  # type: ignore[arg-type]


def test_a_free_seat_gives_the_first_token_after_its_own_prefill_and_a_step() -> None:
    p = predict([replica(occupied=(3.0, 3.0))], [], Work(500, 10))
    assert p.start_s == 0.0
    assert p.ttft_s == pytest.approx(0.5 + 0.05)


def test_with_every_seat_held_it_starts_when_the_first_seat_frees() -> None:
    p = predict([replica(seats=2, occupied=(4.0, 1.5))], [], Work(100, 10))
    assert p.start_s == pytest.approx(1.5)
    assert p.ttft_s == pytest.approx(1.5 + 0.1 + 0.05)


def test_work_ahead_is_counted_in_tokens_not_requests() -> None:
    full = replica(seats=1, occupied=(1.0,))
    short_ahead = predict([full], [Work(100, 10)], Work(100, 10))
    long_ahead = predict([full], [Work(100, 1000)], Work(100, 10))
    # One request ahead either way; its answer's length is what we wait for.
    assert short_ahead.start_s == pytest.approx(1.0 + 0.1 + 10 * 0.05)
    assert long_ahead.start_s == pytest.approx(1.0 + 0.1 + 1000 * 0.05)
    long_prompt = predict([full], [Work(5000, 10)], Work(100, 10))
    assert long_prompt.start_s == pytest.approx(1.0 + 5.0 + 0.5)  # its prefill too


def test_a_replica_still_starting_adds_its_seats_from_when_it_is_ready() -> None:
    busy = replica(seats=1, occupied=(20.0,))
    alone = predict([busy], [], Work(100, 10))
    starting = predict([busy, replica(seats=1, ready_in_s=5.0)], [], Work(100, 10))
    assert alone.start_s == pytest.approx(20.0)
    assert starting.start_s == pytest.approx(5.0)


def test_no_replica_with_seats_is_never() -> None:
    assert not predict([], [], Work(1, 1)).known
    assert not predict([replica(seats=0)], [], Work(1, 1)).known


def test_retry_after_is_the_predicted_excess_within_bounds() -> None:
    p = predict([replica(seats=1, occupied=(10.0,))], [], Work(0, 1))
    assert retry_after_s(p, 2.0, 1.0, 30.0) == pytest.approx(10.05 - 2.0)
    assert retry_after_s(p, 10.0, 1.0, 30.0) == 1.0
    assert retry_after_s(predict([], [], Work(1, 1)), 2.0, 1.0, 30.0) == 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_with(
    *views: WorkerView,
    target: float | None = 2.0,
    clock: Clock | None = None,
    headroom: float = 0.0,
) -> Pool:
    pool = Pool(
        "small", [], None, QueueConfig(), 32, clock=clock or Clock(),  # type: ignore[arg-type]
        ttft_target_s=target, priority_ttft_scale={-1: 0.5, 0: 1.0, 2: 4.0},
        ttft_headroom=headroom,
    )  # fmt: skip
    for v in views:
        pool.views[v.url] = v
    return pool


def ready(url: str, seats: int, running: tuple[int, ...] = (), **kw: float) -> WorkerView:
    view = WorkerView(url, "ready", len(running), 0, 10_000, 10_000, 0, 32, answered=True)
    view.seats = seats
    view.decode_step_s = kw.get("decode_step_s", 0.05)
    view.prefill_tokens_per_s = kw.get("prefill_tokens_per_s", 1000.0)
    view.running_remaining = running
    view.inflight = len(running)
    return view


def ticket(rid: str, prompt: int = 100, max_tokens: int = 100, now: float = 100.0) -> Ticket:
    return Ticket(rid, "t", prompt + max_tokens, now, math.inf, prompt_tokens=prompt,
                  max_tokens=max_tokens, ttft_target_s=2.0)  # fmt: skip


def test_the_pool_refuses_at_arrival_what_its_replicas_cannot_start_in_time() -> None:
    # Both seats held by answers 200 tokens from done: 10 s at 0.05 s a token.
    pool = pool_with(ready("http://a", 2, running=(200, 200)))
    with pytest.raises(OverCapacity) as refused:
        pool.admit(ticket("r1"))
    assert refused.value.predicted_s == pytest.approx(10.0 + 0.1 + 0.05)
    assert 8.0 <= refused.value.retry_after_s <= 8.15 + pool.queue_config.retry_after_jitter_s
    # Answers that end early (the measured completion ratio) free the seats sooner.
    pool.completion_ratio = 0.1
    t = ticket("r2")
    pool.admit(t)
    assert t.start_by == pytest.approx(100.0 + 2.0 - 0.15)


def test_the_pool_counts_its_own_queue_ahead_and_a_starting_replica() -> None:
    clock = Clock()
    pool = pool_with(ready("http://a", 1, running=(10,)), clock=clock)
    pool.admit(ticket("first"))  # 0.5 s until the seat frees: in time
    for i in range(3):
        pool.queue.push(ticket(f"q{i}", max_tokens=100))  # 5 s of decode each
    with pytest.raises(OverCapacity):
        pool.admit(ticket("late"))
    starting = WorkerView("http://b", "loading", 0, 0, 0, 0, 0, 32, joined_at=clock.now)
    pool.views[starting.url] = starting
    pool.start_estimate_s = 1.0
    # Still refused: b's one seat goes to the queue's head, the rest wait behind a.
    with pytest.raises(OverCapacity):
        pool.admit(ticket("late2"))
    starting.seats = None
    pool.queue = type(pool.queue)(pool.queue_config, clock)  # the queue drained
    t = ticket("ok")
    pool.admit(t)


def test_priority_classes_scale_the_target() -> None:
    pool = pool_with(ready("http://a", 1, running=(40,)))  # 2 s until the seat frees
    assert pool.ttft_target_for(0) == 2.0
    assert pool.ttft_target_for(-1) == 1.0
    assert pool.ttft_target_for(-5) == 1.0  # the nearest class
    assert pool.ttft_target_for(3) == 8.0
    relaxed = ticket("batch")
    relaxed.ttft_target_s = pool.ttft_target_for(2)
    pool.admit(relaxed)
    with pytest.raises(OverCapacity):
        pool.admit(ticket("normal"))
    assert pool_with(target=None).ttft_target_for(0) == math.inf


def test_without_a_capacity_model_nothing_is_refused_but_the_start_is_bounded() -> None:
    view = ready("http://a", 1, running=(1000,))
    view.seats = None  # an external server, or a worker still learning
    pool = pool_with(view)
    t = ticket("r")
    pool.admit(t)
    assert t.start_by == pytest.approx(102.0)


def test_a_queued_request_past_its_latest_start_is_refused_before_any_token() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        # No capacity model (nothing predicted at arrival) and one slot, held.
        view = ready("http://a", 1)
        view.seats, view.max_inflight = None, 1
        pool = pool_with(view, clock=loop.time)  # type: ignore[arg-type]
        holder = Lease(pool, ticket("holder", now=loop.time()), None)
        holder.enqueue()
        assert holder.granted
        waiting = Ticket("w", "t", 10, loop.time(), math.inf, prompt_tokens=5, max_tokens=5,
                         ttft_target_s=0.05)  # fmt: skip
        lease = Lease(pool, waiting, None)
        lease.enqueue()
        assert not lease.granted and waiting.start_by <= loop.time() + 0.05
        with pytest.raises(OverCapacity) as refused:
            await lease.wait()
        assert refused.value.predicted_s is None  # late, not predicted
        assert pool.refusals == {"late": 1}
        holder.release(served=True)

    asyncio.run(main())


def test_prefill_is_one_line_per_replica() -> None:
    # Seats free, but 3,000 prompt tokens are already to compute: 3 s at 1,000 a second.
    backlogged = replica(seats=8, prefill_backlog_s=3.0)
    p = predict([backlogged], [], Work(500, 10))
    assert p.start_s == 0.0
    assert p.ttft_s == pytest.approx(3.0 + 0.5 + 0.05)
    # Two long prompts given to it before ours: ours waits for both prefills.
    p = predict([replica(seats=8)], [Work(1000, 10), Work(1000, 10)], Work(500, 10))
    assert p.ttft_s == pytest.approx(2.0 + 0.5 + 0.05)
    # A second replica with a free line is the quicker one.
    p = predict([backlogged, replica(seats=1)], [], Work(500, 10))
    assert p.ttft_s == pytest.approx(0.55)


def test_would_miss_tells_the_cascade_the_large_pool_is_pressed() -> None:
    """`Pool.would_miss` answers what `admit` would (without queuing anything): the cascade
    overflows a large-routed request to the small pool instead of refusing it."""
    pool = pool_with(ready("http://a", 1, running=(20,)))  # 1 s until the seat frees
    assert not pool.would_miss("t", 100, 50, priority=0)  # 1 s + 0.1 s prefill < 2 s
    assert pool.would_miss("t", 2000, 50, priority=0)  # + 2 s of prefill: past 2 s
    assert pool.would_miss("t", 100, 50, priority=-1)  # its class's target is 1 s
    assert len(pool.queue) == 0 and pool.refusals == {}
    assert not pool_with(ready("http://a", 1, running=(20,)), target=None).would_miss(
        "t", 10**6, 50, priority=0
    )  # no target: never pressed by prediction


def test_the_target_counts_from_arrival_and_the_measured_error_is_added() -> None:
    """Time a request spent before the queue (its intake in a burst) is charged to its
    target, and the mean error of earlier streams' predictions (`ttft_bias_s`, learned
    at their first token) is added: both refuse what the bare model would accept."""
    clock = Clock()
    pool = pool_with(ready("http://a", 1, running=(30,)), clock=clock)  # 1.5 s to a seat
    on_time = ticket("on-time")
    pool.admit(on_time)  # 1.5 + 0.1 + 0.05 s: within 2 s
    assert on_time.predicted_ttft_s == pytest.approx(1.65)
    assert on_time.start_by == pytest.approx(100.0 + 2.0 - 0.15)
    slow_intake = ticket("slow-intake")
    slow_intake.arrived_at = clock.now - 0.5  # half a second before it reached the queue
    with pytest.raises(OverCapacity) as refused:
        pool.admit(slow_intake)
    assert refused.value.predicted_s == pytest.approx(2.15)
    clock.now += 2.15  # its first token came 2.15 s after arrival: 0.5 s late
    for _ in range(60):
        pool.record_ttft(2.15, on_time)
    assert pool.ttft_bias_s == pytest.approx(0.5, abs=0.01)
    clock.now = 100.0
    with pytest.raises(OverCapacity):
        pool.admit(ticket("after-learning"))  # 1.65 + 0.5 s of measured error > 2 s


def test_the_headroom_keeps_a_share_of_the_target_back() -> None:
    """With 10% headroom a request predicted at 1.85 s of a 2 s target is refused (it aims
    at 1.8 s), its refusal still names the 2 s target, and one queued must start early
    enough to meet 1.8 s; the cascade's `would_miss` answers the same."""
    running = (34,)  # 1.7 s until the seat frees, + 0.1 s prefill + 0.05 s first step
    assert pool_with(ready("http://a", 1, running=running)).admit(ticket("no-headroom")) is None
    pool = pool_with(ready("http://a", 1, running=running), headroom=0.1)
    with pytest.raises(OverCapacity) as refused:
        pool.admit(ticket("late"))
    assert refused.value.predicted_s == pytest.approx(1.85)
    assert refused.value.target_s == pytest.approx(2.0)
    assert "after 1.85 s, past 1.80 s (the TTFT target of 2.00 s less 10% headroom)" in str(
        refused.value
    )
    assert pool.would_miss("t", 100, 100, priority=0)
    on_time = ticket("on-time", prompt=10)  # 1.7 + 0.01 + 0.05 s: within 1.8 s
    pool.admit(on_time)
    assert on_time.start_by == pytest.approx(100.0 + 1.8 - 0.06)
    assert not pool.would_miss("t", 10, 100, priority=0)


def test_requests_sent_since_the_last_report_count_by_their_own_size() -> None:
    # Two long prompts just sent, not in the worker's last report (inflight, no running):
    # their prefill (2 x 2,000 tokens at 1,000 a second) is ahead of a short one.
    view = ready("http://a", 8)
    pool = pool_with(view)
    for rid in ("long1", "long2"):
        assert pool.claim_slot(None, (), ticket(rid, prompt=2000, max_tokens=10)) is view
    assert list(view.sent) == ["long1", "long2"]
    prediction = pool.predict(ticket("short", prompt=10, max_tokens=10))
    assert prediction.ttft_s == pytest.approx(4.0 + 0.01 + 0.05)
    with pytest.raises(OverCapacity):
        pool.admit(ticket("short2", prompt=10, max_tokens=10))
    # Once the report shows them (or they end), the sizes go with their slots.
    pool.free_slot(view, ticket("long1"))
    pool.free_slot(view, ticket("long2"))
    assert view.sent == {} and view.inflight == 0
    assert pool.predict(ticket("short3", prompt=10, max_tokens=10)).ttft_s == pytest.approx(0.06)
