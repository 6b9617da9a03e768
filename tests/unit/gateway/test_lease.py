"""The Lease: one owner for a request's queue turn and worker slot."""

import asyncio
import math
import time

import pytest

from gateway.capacity.fair_queue import QueueConfig, Ticket
from gateway.capacity.lease import Lease, NoReplica
from gateway.capacity.pool import Pool
from gateway.capacity.refusals import QueueFull


def make_pool(num_workers: int = 2, max_inflight: int = 1, **queue) -> Pool:
    pool = Pool(
        "small",
        [f"http://w{i}" for i in range(num_workers)],
        client=None,  # type: ignore[arg-type] (no polling in these tests)
        queue_config=QueueConfig(**queue),
        max_inflight_per_worker=max_inflight,
    )
    for view in pool.views.values():
        view.state = "ready"
    return pool


def ticket(rid: str, tenant: str = "t") -> Ticket:
    return Ticket(rid, tenant, 100, time.monotonic(), math.inf)


def inflight(pool: Pool) -> list[int]:
    return [v.inflight for v in pool.views.values()]


def run(coro):
    return asyncio.run(coro)


def test_a_lease_granted_at_once_holds_one_slot_until_released() -> None:
    async def main() -> None:
        pool = make_pool()
        lease = Lease(pool, ticket("a"), None)
        lease.enqueue()
        await lease.wait()
        assert lease.granted and sum(inflight(pool)) == 1
        assert pool.controller.num_dispatched == 1
        lease.release(served=True)
        lease.release(served=True)  # idempotent
        assert sum(inflight(pool)) == 0 and pool.controller.num_dispatched == 0
        assert len(pool._finished) == 1

    run(main())


def test_a_refused_request_is_not_counted_as_a_completion() -> None:
    async def main() -> None:
        pool = make_pool()
        lease = Lease(pool, ticket("a"), None)
        lease.enqueue()
        await lease.wait()
        lease.release(served=False)
        assert len(pool._finished) == 0 and sum(inflight(pool)) == 0

    run(main())


def test_next_worker_moves_the_slot_to_a_replica_not_tried() -> None:
    async def main() -> None:
        pool = make_pool(num_workers=2)
        lease = Lease(pool, ticket("a"), None)
        lease.enqueue()
        await lease.wait()
        first = lease.next_worker()
        second = lease.next_worker()
        assert first.url != second.url
        assert first.inflight == 0 and second.inflight == 1
        lease.release(served=False)
        assert sum(inflight(pool)) == 0

    run(main())


def test_next_worker_raises_no_replica_when_none_has_room() -> None:
    async def main() -> None:
        pool = make_pool(num_workers=1)
        lease = Lease(pool, ticket("a"), None)
        lease.enqueue()
        await lease.wait()
        lease.next_worker()
        pool.views["http://w0"].state = "unreachable"
        with pytest.raises(NoReplica):
            lease.next_worker()
        lease.release(served=False)
        assert sum(inflight(pool)) == 0 and pool.controller.num_dispatched == 0

    run(main())


def test_a_queued_lease_released_leaves_the_queue_and_the_next_one_goes() -> None:
    async def main() -> None:
        pool = make_pool(num_workers=1)
        holder, queued, third = (Lease(pool, ticket(r), None) for r in "abc")
        holder.enqueue()
        await holder.wait()
        queued.enqueue()
        third.enqueue()
        assert len(pool.queue) == 2
        queued.release(served=False)  # its client left while it waited
        assert len(pool.queue) == 1
        waiter = asyncio.ensure_future(third.wait())
        holder.release(served=True)
        await asyncio.wait_for(waiter, 1)
        assert third.granted and third.worker is not None
        third.release(served=True)
        assert sum(inflight(pool)) == 0 and pool.controller.num_dispatched == 0

    run(main())


def test_a_cancelled_wait_leaves_nothing_behind() -> None:
    async def main() -> None:
        pool = make_pool(num_workers=1)
        holder, queued = Lease(pool, ticket("a"), None), Lease(pool, ticket("b"), None)
        holder.enqueue()
        await holder.wait()
        queued.enqueue()
        waiter = asyncio.ensure_future(queued.wait())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        queued.release(served=False)  # the owner's release after a cancelled wait: no-op
        assert len(pool.queue) == 0
        holder.release(served=True)
        assert sum(inflight(pool)) == 0 and pool.controller.num_dispatched == 0

    run(main())


def test_a_full_queue_refuses_at_enqueue() -> None:
    async def main() -> None:
        pool = make_pool(num_workers=1, max_requests=1)
        holder = Lease(pool, ticket("a"), None)
        holder.enqueue()
        await holder.wait()
        Lease(pool, ticket("b"), None).enqueue()
        with pytest.raises(QueueFull):
            Lease(pool, ticket("c"), None).enqueue()

    run(main())
