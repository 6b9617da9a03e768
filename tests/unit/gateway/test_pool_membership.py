"""Pool membership at runtime (a supervisor adds and removes replicas) and the rates the
autoscaler reads (arrivals offered, service time of served requests)."""

import asyncio
import math

from gateway.capacity.fair_queue import QueueConfig, Ticket
from gateway.capacity.lease import Lease
from gateway.capacity.pool import Pool


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_pool(clock: Clock) -> Pool:
    return Pool("small", [], None, QueueConfig(), 4, clock=clock)  # type: ignore[arg-type]


def test_a_member_added_at_runtime_is_loading_until_ready_and_a_lost_one_wakes_waiters() -> None:
    async def main() -> None:
        pool = make_pool(Clock())
        pool.add_member("http://w1/")
        assert list(pool.views) == ["http://w1"]
        assert pool.views["http://w1"].state == "loading" and not pool.has_room()
        pool.views["http://w1"].state = "ready"
        assert pool.has_room()
        lost = pool.lost("http://w1")
        pool.remove_member("http://w1", lost=True)
        assert lost.done() and pool.views == {} and not pool.has_room()
        pool.add_member("http://w1")  # the same port again after a restart: a fresh view
        assert not pool.lost("http://w1").done()

    asyncio.run(main())


def test_rates_count_every_offer_and_the_slot_time_of_served_requests() -> None:
    async def main() -> None:
        clock = Clock()
        pool = make_pool(clock)
        pool.add_member("http://w1")
        pool.views["http://w1"].state = "ready"
        assert pool.rates(10.0) == (0.0, None)
        for i in range(4):
            lease = Lease(pool, Ticket(f"r{i}", "t", 10, 0.0, math.inf), None)
            lease.enqueue()
            await lease.wait()
            clock.now += 2.0
            lease.release(served=i < 2)  # two refused by the worker: no service time
        arrivals, service = pool.rates(10.0)
        assert arrivals == 0.4 and service == 2.0
        clock.now += 60.0  # quiet: no arrivals, but the pool keeps its service time
        assert pool.rates(10.0) == (0.0, 2.0)

    asyncio.run(main())
