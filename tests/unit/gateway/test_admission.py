"""Admission: the fair queue (bounds, DRR, deadlines) and its asyncio controller.
Fairness between tenants at the slots: test_admission_fairness.py."""

import asyncio
import math
import random
import time

import pytest

from gateway.capacity.fair_queue import FairQueue, QueueConfig
from gateway.capacity.refusals import DeadlineExceeded, QueueFull
from tests.unit.gateway.admission_support import (
    FakeClock,
    make_controller,
    make_queue,
    make_ticket,
    pop_all,
    run,
    serve,
)

# FairQueue: bounds


def test_push_past_max_requests_raises_queue_full_with_jittered_retry_after() -> None:
    queue = make_queue(max_requests=3, retry_after_s=1.0, retry_after_jitter_s=1.0)
    for i in range(3):
        queue.push(make_ticket(f"a{i}"))
    retry_after_s = []
    for i in range(20):  # the same tenant: it holds the whole queue already
        with pytest.raises(QueueFull) as refused:
            queue.push(make_ticket(f"a{i + 3}", cost_tokens=1))
        assert refused.value.reason == "requests"
        retry_after_s.append(refused.value.retry_after_s)
    assert all(1.0 <= s <= 2.0 for s in retry_after_s)
    assert len(set(retry_after_s)) == 20  # refused clients do not return as one wave
    assert len(queue) == 3


def test_a_full_queue_pushes_out_the_newest_of_the_tenant_holding_the_most() -> None:
    queue = make_queue(max_requests=4)
    for i in range(4):
        queue.push(make_ticket(f"a{i}", cost_tokens=100))
    assert [t.request_id for t in queue.push(make_ticket("b0", cost_tokens=100))] == ["a3"]
    assert [t.request_id for t in queue.push(make_ticket("b1", cost_tokens=100))] == ["a2"]
    with pytest.raises(QueueFull):  # 2 and 2: b would hold more than a, so b is refused
        queue.push(make_ticket("b2", cost_tokens=100))
    assert len(queue) == 4 and queue.waiting_tokens == 400
    assert pop_all(queue) == ["a0", "a1", "b0", "b1"]


def test_push_past_max_tokens_raises_queue_full_but_smaller_tickets_fit() -> None:
    queue = make_queue(max_tokens=5000, retry_after_s=3.0, retry_after_jitter_s=0.5)
    queue.push(make_ticket("a1", cost_tokens=2000))
    queue.push(make_ticket("b1", cost_tokens=2000))
    with pytest.raises(QueueFull) as refused:
        queue.push(make_ticket("a2", cost_tokens=2000))
    assert refused.value.reason == "tokens"
    assert 3.0 <= refused.value.retry_after_s <= 3.5
    queue.push(make_ticket("a3", cost_tokens=1000))
    assert queue.waiting_tokens == 5000
    assert len(queue) == 3


def test_an_oversized_ticket_is_admitted_only_into_an_empty_queue() -> None:
    queue = make_queue(max_tokens=5000)
    queue.push(make_ticket("a1", cost_tokens=10))
    with pytest.raises(QueueFull):
        queue.push(make_ticket("b1", cost_tokens=8000))
    assert pop_all(queue) == ["a1"]
    queue.push(make_ticket("b1", cost_tokens=8000))  # alone it can never be refused forever
    assert pop_all(queue) == ["b1"]


def test_push_rejects_a_duplicate_request_id_and_bad_weight() -> None:
    queue = make_queue()
    queue.push(make_ticket("a1"))
    with pytest.raises(ValueError):
        queue.push(make_ticket("a1"))
    with pytest.raises(ValueError):
        queue.push(make_ticket("a2", weight=0.0))
    assert len(queue) == 1


# FairQueue: order


def test_fifo_within_a_tenant() -> None:
    queue = make_queue()
    ids = [f"a{i}" for i in range(30)]
    for request_id in ids:
        queue.push(make_ticket(request_id, cost_tokens=777))
    assert pop_all(queue) == ids


def test_a_flooding_tenant_cannot_delay_a_later_tenant_much() -> None:
    # A queues 100 requests, B 5 afterwards. With 1000-token requests and a 4096-token
    # quantum, each visit sends 4 requests, so B is done by pop 13 (FIFO: pop 105).
    queue = make_queue(quantum_tokens=4096)
    for i in range(100):
        queue.push(make_ticket(f"a{i}"))
    for i in range(5):
        queue.push(make_ticket(f"b{i}"))
    order = pop_all(queue)
    b_positions = [pos for pos, rid in enumerate(order) if rid[0] == "b"]
    assert b_positions == [4, 5, 6, 7, 12]
    assert [rid for rid in order if rid[0] == "a"] == [f"a{i}" for i in range(100)]


def test_a_continuous_flood_cannot_starve_a_newcomer() -> None:
    queue = make_queue(max_requests=64, quantum_tokens=4096)
    for i in range(64):
        queue.push(make_ticket(f"a{i}"))
    next_a = 64
    pops_until_b = None
    for pop_index in range(200):
        if pop_index == 50:
            queue.push(make_ticket("b0"))  # the queue is full of A when B turns up
        ticket, _ = queue.pop()
        if ticket.request_id == "b0":
            pops_until_b = pop_index - 50
            break
        while len(queue) < 63:  # A refills as fast as it is served
            queue.push(make_ticket(f"a{next_a}"))
            next_a += 1
    assert pops_until_b is not None and pops_until_b <= 4


def test_fairness_is_by_tokens_not_by_requests() -> None:
    # A sends 4000-token requests, B 500-token ones: B gets 8 requests per A request.
    queue = make_queue(quantum_tokens=4096)
    for i in range(50):
        queue.push(make_ticket(f"a{i}", cost_tokens=4000))
        queue.push(make_ticket(f"b{i}", cost_tokens=500))
    tokens = {"a": 0, "b": 0}
    for _ in range(45):
        ticket, _ = queue.pop()
        tokens[ticket.tenant_id] += ticket.cost_tokens
    assert tokens == {"a": 20000, "b": 20000}


def test_weights_share_tokens_in_proportion() -> None:
    queue = make_queue(quantum_tokens=4096)
    for i in range(100):
        queue.push(make_ticket(f"a{i}", cost_tokens=1024, weight=3.0))
        queue.push(make_ticket(f"b{i}", cost_tokens=1024, weight=1.0))
    counts = {"a": 0, "b": 0}
    for _ in range(64):
        ticket, _ = queue.pop()
        counts[ticket.tenant_id] += 1
    assert counts == {"a": 48, "b": 16}


def test_a_ticket_far_larger_than_the_quantum_is_served_without_spinning() -> None:
    # 1-token quantum: B's ticket needs a million visits, A's two million. DRR order
    # (fewest visits first) holds, and the empty rounds are skipped, not looped through.
    queue = make_queue(quantum_tokens=1, max_tokens=10_000_000)
    queue.push(make_ticket("a1", cost_tokens=2_000_000))
    queue.push(make_ticket("b1", cost_tokens=1_000_000))
    started = time.perf_counter()
    assert pop_all(queue) == ["b1", "a1"]
    assert time.perf_counter() - started < 0.05


def test_skipping_empty_rounds_never_changes_the_drr_order() -> None:
    class PlainDRR(FairQueue):
        def _fast_forward(self, now: float, skipped: set[str]) -> None:
            pass  # visit every round one by one: the reference order

    for trial in range(40):
        rng = random.Random(trial)
        config = QueueConfig(
            max_requests=1000, max_tokens=10**9, quantum_tokens=rng.choice([7, 100])
        )
        queues = [FairQueue(config, FakeClock()), PlainDRR(config, FakeClock())]
        weights = {tenant: rng.choice([0.5, 1.0, 3.0]) for tenant in "abcd"}
        orders: list[list[str | None]] = [[], []]
        for n in range(60):
            if rng.random() < 0.6:
                tenant = rng.choice("abcd")
                cost = rng.choice([1, 50, 800, 3000])
                for queue in queues:
                    queue.push(
                        make_ticket(f"{tenant}{n}", cost_tokens=cost, weight=weights[tenant])
                    )
            else:
                for queue, order in zip(queues, orders, strict=True):
                    ticket, _ = queue.pop()
                    order.append(ticket and ticket.request_id)
        for queue, order in zip(queues, orders, strict=True):
            order.extend(pop_all(queue))
        assert orders[0] == orders[1]


# FairQueue: deadlines, removal, estimates


def test_expired_tickets_are_dropped_at_dequeue_and_never_popped() -> None:
    clock = FakeClock(0.0)
    queue = make_queue(clock)
    queue.push(make_ticket("a1", deadline=5.0))
    queue.push(make_ticket("a2", deadline=100.0))
    queue.push(make_ticket("b1", deadline=5.0))
    queue.push(make_ticket("b2", deadline=10.0))  # exactly now: expired
    clock.now = 10.0
    ticket, dropped = queue.pop()
    assert ticket.request_id == "a2"
    assert [t.request_id for t in dropped] == ["a1"]
    ticket, dropped = queue.pop()
    assert ticket is None
    assert [t.request_id for t in dropped] == ["b1", "b2"]
    assert len(queue) == 0 and queue.waiting_tokens == 0


def test_remove_takes_a_waiting_ticket_out() -> None:
    queue = make_queue()
    for request_id in ["a1", "a2", "a3", "b1"]:
        queue.push(make_ticket(request_id, cost_tokens=100))
    assert queue.remove("a2")
    assert queue.remove("b1")  # B's only ticket: B leaves the ring
    assert not queue.remove("a2")
    assert not queue.remove("nope")
    assert len(queue) == 2 and queue.waiting_tokens == 200
    assert pop_all(queue) == ["a1", "a3"]
    queue.push(make_ticket("a2", cost_tokens=100))  # its id may be used again
    assert pop_all(queue) == ["a2"]


def test_estimated_wait_is_waiting_tokens_over_drain_rate() -> None:
    queue = make_queue()
    assert queue.estimated_wait_s(0.0) == 0.0
    queue.push(make_ticket("a1", cost_tokens=3000))
    queue.push(make_ticket("b1", cost_tokens=1000))
    assert queue.estimated_wait_s(2000.0) == pytest.approx(2.0)
    assert queue.estimated_wait_s(0.0) == math.inf


# AdmissionController


def test_acquire_dispatches_without_waiting_when_queue_empty_and_room() -> None:
    async def main() -> None:
        ctl, _ = make_controller(capacity=1)
        coro = ctl.acquire(make_ticket("a1"))
        with pytest.raises(StopIteration):  # finished on its first step: no loop turn
            coro.send(None)
        assert ctl.num_dispatched == 1 and ctl.num_waiting == 0

    run(main())


def test_a_newcomer_does_not_overtake_a_dispatched_waiter_that_has_not_resumed() -> None:
    async def main() -> None:
        ctl, pool = make_controller(capacity=0)
        order: list[str] = []
        first = asyncio.create_task(serve(ctl, pool, make_ticket("a1"), order))
        await asyncio.sleep(0)
        pool.capacity = 1
        ctl.kick()  # a1 dispatched; has_room() is still true until its task takes the slot
        assert ctl.num_waiting == 0 and pool.has_room()
        # Arrive in this same step, before a1's task resumes: the queue is empty and
        # has_room() says yes, yet the slot is a1's.
        await serve(ctl, pool, make_ticket("b1"), order)
        await first
        assert order == ["a1", "b1"]
        assert pool.max_seen == 1

    run(main())


def test_waiters_are_dispatched_on_release_in_fair_order() -> None:
    async def main() -> None:
        ctl, pool = make_controller(capacity=1, quantum_tokens=1000)
        order: list[str] = []
        done = asyncio.Event()
        blocker = asyncio.create_task(serve(ctl, pool, make_ticket("x0"), order, hold=done))
        ids = ["a1", "a2", "a3", "a4", "b1", "b2"]
        tasks = [asyncio.create_task(serve(ctl, pool, make_ticket(i), order)) for i in ids]
        await asyncio.sleep(0.001)
        assert order == ["x0"] and ctl.num_waiting == 6
        done.set()
        await asyncio.gather(blocker, *tasks)
        assert order == ["x0", "a1", "b1", "a2", "b2", "a3", "a4"]
        assert pool.max_seen == 1
        assert ctl.num_waiting == 0 and ctl.num_dispatched == 0

    run(main())


def test_never_more_dispatched_than_has_room_allows() -> None:
    async def main() -> None:
        ctl, pool = make_controller(capacity=3)
        rng = random.Random(1)
        order: list[str] = []
        tasks = [
            asyncio.create_task(
                serve(ctl, pool, make_ticket(f"{t}{i}"), order, hold=rng.randint(0, 5))
            )
            for i in range(15)
            for t in "abc"
        ]
        await asyncio.gather(*tasks)
        assert len(order) == 45
        assert pool.max_seen == 3
        assert pool.inflight == 0 and ctl.num_waiting == 0

    run(main())


def test_kick_dispatches_when_capacity_appears() -> None:
    async def main() -> None:
        ctl, pool = make_controller(capacity=0)
        order: list[str] = []
        task = asyncio.create_task(serve(ctl, pool, make_ticket("a1"), order))
        await asyncio.sleep(0.001)
        assert order == [] and ctl.num_waiting == 1
        pool.capacity = 1  # worker loads refreshed
        ctl.kick()
        await task
        assert order == ["a1"]

    run(main())


def test_acquire_raises_queue_full_at_once() -> None:
    async def main() -> None:
        ctl, _ = make_controller(capacity=0, max_requests=1)
        waiting = asyncio.create_task(ctl.acquire(make_ticket("a1")))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as refused:
            await ctl.acquire(make_ticket("b1"))
        assert refused.value.reason == "requests"
        assert ctl.num_waiting == 1
        waiting.cancel()

    run(main())


def test_deadline_timer_fails_a_waiter_even_when_nothing_is_dispatched() -> None:
    async def main() -> None:
        ctl, _ = make_controller(capacity=0)
        started = time.monotonic()
        ticket = make_ticket("a1", deadline=started + 0.05)
        with pytest.raises(DeadlineExceeded) as missed:
            await ctl.acquire(ticket)
        waited_s = time.monotonic() - started
        assert 0.045 <= waited_s < 1.0
        assert missed.value.request_id == "a1"
        assert ctl.num_waiting == 0

    run(main())


def test_a_deadline_already_past_fails_without_queueing() -> None:
    async def main() -> None:
        clock = FakeClock(10.0)
        ctl, _ = make_controller(capacity=1, clock=clock)
        with pytest.raises(DeadlineExceeded):
            await ctl.acquire(make_ticket("a1", deadline=10.0))
        assert ctl.num_waiting == 0 and ctl.num_dispatched == 0

    run(main())


def test_an_expired_waiter_fails_at_dispatch_and_the_next_one_goes() -> None:
    async def main() -> None:
        clock = FakeClock(0.0)
        ctl, pool = make_controller(capacity=0, clock=clock)
        order: list[str] = []
        late = asyncio.create_task(serve(ctl, pool, make_ticket("a1", deadline=10.0), order))
        fine = asyncio.create_task(serve(ctl, pool, make_ticket("a2", deadline=99.0), order))
        await asyncio.sleep(0)
        clock.now = 20.0  # the real timer (10 s away) has not fired; dispatch finds it
        pool.capacity = 1
        ctl.kick()
        with pytest.raises(DeadlineExceeded) as missed:
            await late
        assert missed.value.waited_s == 20.0
        await fine
        assert order == ["a2"]

    run(main())


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    async def main() -> None:
        ctl, pool = make_controller(capacity=0)
        order: list[str] = []
        gone = asyncio.create_task(serve(ctl, pool, make_ticket("a1"), order))
        stays = asyncio.create_task(serve(ctl, pool, make_ticket("a2"), order))
        await asyncio.sleep(0)
        assert ctl.num_waiting == 2
        gone.cancel()  # client disconnect
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert ctl.num_waiting == 1
        pool.capacity = 1
        ctl.kick()
        await stays
        assert order == ["a2"]

    run(main())


def test_a_waiter_cancelled_after_dispatch_passes_its_turn_on() -> None:
    async def main() -> None:
        ctl, pool = make_controller(capacity=0)
        order: list[str] = []
        first = asyncio.create_task(serve(ctl, pool, make_ticket("a1"), order))
        second = asyncio.create_task(serve(ctl, pool, make_ticket("b1"), order))
        await asyncio.sleep(0)
        pool.capacity = 1
        ctl.kick()  # dispatches a1; its task has not resumed yet
        assert ctl.num_waiting == 1
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await second
        assert order == ["b1"]
        assert pool.max_seen == 1 and ctl.num_dispatched == 0

    run(main())
