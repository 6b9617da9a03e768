"""Fairness between tenants at the worker slots: a reserve for tenants under their share,
their priority, a full queue that pushes out the flood's newest, and the queue's longest
wait."""

import asyncio
import time

import pytest

from gateway.capacity.refusals import DeadlineExceeded, QueueFull
from tests.unit.gateway.admission_support import (
    make_controller,
    make_queue,
    make_reserving_controller,
    make_ticket,
    pop_all,
    run,
    serve,
)

# -- fairness at the slots: a reserve for tenants under their share -------------------------


def test_pop_passes_over_a_tenant_that_may_not_take_a_slot_and_keeps_its_place() -> None:
    queue = make_queue(quantum_tokens=1000)
    for request_id in ["a1", "a2", "b1", "b2"]:
        queue.push(make_ticket(request_id))
    ticket, _ = queue.pop(lambda tenant: tenant != "a")
    assert ticket.request_id == "b1"
    assert queue.pop(lambda tenant: False) == (None, [])
    assert len(queue) == 3
    assert pop_all(queue) == ["a1", "b2", "a2"]


def test_one_tenant_alone_may_use_every_slot() -> None:
    async def main() -> None:
        ctl, pool = make_reserving_controller(8, reserve_fraction=0.25)
        for i in range(8):
            assert ctl.enqueue(make_ticket(f"a{i}", cost_tokens=10)) is None
            pool.take()
        assert ctl.dispatched_of("a") == 8

    run(main())


def test_a_flooding_tenant_leaves_the_reserve_to_a_light_one_who_gets_a_slot_at_once() -> None:
    async def main() -> None:
        ctl, pool = make_reserving_controller(8, reserve_fraction=0.25)  # reserve: 2 slots
        order: list[str] = []
        hold = asyncio.Event()

        def request(request_id: str) -> asyncio.Task:
            ticket = make_ticket(request_id, cost_tokens=10)
            return asyncio.create_task(serve(ctl, pool, ticket, order, hold))

        tasks = [request("b0")]  # the light tenant is active
        await asyncio.sleep(0)
        tasks += [request(f"a{i}") for i in range(20)]
        for _ in range(10):
            await asyncio.sleep(0)
        # The heavy one stops where only the reserve is left: 1 + 5 in flight, 2 free.
        assert ctl.dispatched_of("a") == 5 and pool.inflight == 6
        tasks.append(request("b1"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert order[-1] == "b1"  # a reserved slot at once, ahead of 15 waiting
        hold.set()
        await asyncio.gather(*tasks)
        assert len(order) == 22

    run(main())


def test_over_its_share_a_tenant_still_gets_its_fair_share_of_slots() -> None:
    """Two flooding tenants: neither is held back below total / 2 by the reserve."""

    async def main() -> None:
        ctl, pool = make_reserving_controller(8, reserve_fraction=0.25)
        order: list[str] = []
        hold = asyncio.Event()
        tasks = [
            asyncio.create_task(
                serve(ctl, pool, make_ticket(f"{t}{i}", cost_tokens=10), order, hold)
            )
            for i in range(10)
            for t in "ab"
        ]
        for _ in range(5):
            await asyncio.sleep(0)
        assert ctl.dispatched_of("a") == 4 and ctl.dispatched_of("b") == 4
        hold.set()
        await asyncio.gather(*tasks)
        assert sorted(order) == sorted(f"{t}{i}" for i in range(10) for t in "ab")

    run(main())


def test_the_share_counts_work_in_flight_so_long_prompts_make_a_tenant_heavy() -> None:
    """Each tenant holds 3 of 8 slots, so by requests both are under their share of 4; but
    the heavy tenant's 3 hold 6,000 tokens of work against the light one's 150. With only
    the reserve left, the light tenant's next request goes first, though the heavy one's
    was queued before it."""

    async def main() -> None:
        ctl, pool = make_reserving_controller(8, reserve_fraction=0.25)  # reserve: 2 slots
        order: list[str] = []
        hold = asyncio.Event()

        def request(request_id: str, cost_tokens: int) -> asyncio.Task:
            ticket = make_ticket(request_id, cost_tokens=cost_tokens)
            return asyncio.create_task(serve(ctl, pool, ticket, order, hold))

        tasks = [request(f"h{i}", 2000) for i in range(3)]
        tasks += [request(f"l{i}", 50) for i in range(3)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert pool.inflight == 6 and ctl.dispatched_of("h") == ctl.dispatched_of("l") == 3
        assert ctl.dispatched_tokens_of("h") == 6000 and ctl.dispatched_tokens_of("l") == 150
        tasks.append(request("h3", 50))  # queued first, as cheap as the light one's
        for _ in range(3):
            await asyncio.sleep(0)
        assert order[-1] == "l2" and ctl.num_waiting == 1  # only the reserve is left
        tasks.append(request("l3", 50))
        for _ in range(3):
            await asyncio.sleep(0)
        assert order[-1] == "l3"
        assert ctl.dispatched_of("h") == 3 and ctl.num_waiting == 1
        hold.set()
        await asyncio.gather(*tasks)
        assert len(order) == 8
        assert ctl.dispatched_tokens_of("h") == ctl.dispatched_tokens_of("l") == 0

    run(main())


def test_a_request_that_waits_past_the_queues_max_wait_is_refused_from_the_queue() -> None:
    async def main() -> None:
        ctl, pool = make_controller(capacity=1, max_wait_s=0.05)
        assert ctl.enqueue(make_ticket("a1")) is None
        pool.take()
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as err:
            await ctl.acquire(make_ticket("b1"))  # no deadline of its own
        assert err.value.stage == "queue"
        assert 0.04 <= time.monotonic() - t0 < 1.0
        assert ctl.num_waiting == 0

    run(main())


def test_a_ticket_pushed_out_of_the_queue_is_refused_with_retry_after() -> None:
    async def main() -> None:
        ctl, pool = make_controller(capacity=1, max_requests=2)
        assert ctl.enqueue(make_ticket("a0")) is None
        pool.take()
        flood = [asyncio.ensure_future(ctl.acquire(make_ticket(f"a{i}"))) for i in (1, 2)]
        await asyncio.sleep(0)
        light = asyncio.ensure_future(ctl.acquire(make_ticket("b1")))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as refused:
            await flood[1]  # the flood's newest made room for the light tenant
        assert refused.value.retry_after_s >= 1.0
        assert not flood[0].done() and not light.done() and ctl.num_waiting == 2
        for f in (flood[0], light):
            f.cancel()

    run(main())


def test_the_next_free_slot_goes_to_a_tenant_under_its_share_before_a_floods_turn() -> None:
    async def main() -> None:
        # No reserve, a quantum that gives the flood long turns: only the priority of
        # tenants under their share can put the light request first.
        ctl, pool = make_reserving_controller(4, reserve_fraction=0.0, quantum_tokens=10_000)
        order: list[str] = []
        hold = asyncio.Event()

        def request(request_id: str) -> asyncio.Task:
            ticket = make_ticket(request_id, cost_tokens=10)
            return asyncio.create_task(serve(ctl, pool, ticket, order, hold))

        tasks = [request(f"a{i}") for i in range(10)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert order == ["a0", "a1", "a2", "a3"] and ctl.num_waiting == 6
        tasks.append(request("b0"))
        await asyncio.sleep(0)
        hold.set()
        await asyncio.gather(*tasks)
        assert order.index("b0") == 4  # the first slot that freed

    run(main())
