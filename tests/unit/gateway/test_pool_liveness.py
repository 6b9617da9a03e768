"""A pool with no live replica refuses at once (NoReplica: 503 with Retry-After) instead of
queueing requests for a replica that is not coming, and refuses what already waits at the
next load poll; a pool whose replicas are starting, loading or busy queues as before."""

import asyncio
import math

import pytest

from gateway.capacity.balancer import WorkerView, is_live
from gateway.capacity.fair_queue import QueueConfig, Ticket
from gateway.capacity.lease import Lease
from gateway.capacity.pool import Pool
from gateway.capacity.refusals import NoReplica


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def view(state: str, answered: bool = True, joined_at: float = 0.0) -> WorkerView:
    return WorkerView("http://w", state, 0, 0, 0, 0, 0, 4, joined_at=joined_at, answered=answered)


def test_ready_loading_and_starting_replicas_are_live_and_lost_ones_are_not() -> None:
    grace = 30.0
    assert is_live(view("ready"), 100.0, grace)
    busy = view("ready")
    busy.inflight = busy.max_inflight
    assert is_live(busy, 100.0, grace)  # busy is live: wait for it
    assert is_live(view("loading", answered=False), 100.0, grace)  # never polled yet
    assert is_live(view("loading"), 1e9, grace)  # warming up, however long it takes
    # Silent since it joined: its server is still starting, for the grace only.
    assert is_live(view("unreachable", answered=False, joined_at=80.0), 100.0, grace)
    assert not is_live(view("unreachable", answered=False, joined_at=60.0), 100.0, grace)
    assert not is_live(view("unreachable", joined_at=99.0), 100.0, grace)  # it had answered
    assert not is_live(view("stalled"), 100.0, grace)
    assert not is_live(view("draining"), 100.0, grace)


def make_pool(clock: Clock, states: list[str], max_inflight: int = 1) -> Pool:
    pool = Pool(
        "small",
        [f"http://w{i}" for i in range(len(states))],
        client=None,  # type: ignore[arg-type] (no polling in these tests)
        queue_config=QueueConfig(retry_after_s=1.5),
        max_inflight_per_worker=max_inflight,
        clock=clock,
    )
    for v, state in zip(pool.views.values(), states, strict=True):
        v.state, v.answered = state, state != "loading"
    return pool


def lease(pool: Pool, rid: str) -> Lease:
    return Lease(pool, Ticket(rid, "t", 10, pool.clock(), math.inf), None)


@pytest.mark.parametrize(
    "states", [["unreachable", "unreachable"], ["stalled", "draining"], ["unreachable"], []]
)
def test_a_request_to_a_pool_with_no_live_replica_is_refused_at_once(states: list[str]) -> None:
    async def main() -> None:
        pool = make_pool(Clock(), states)
        refused = lease(pool, "a")
        with pytest.raises(NoReplica) as info:
            refused.enqueue()
        assert info.value.retry_after_s == 1.5 and "small" in str(info.value)
        assert len(pool.queue) == 0 and pool.controller.num_dispatched == 0
        refused.release(served=False)

    asyncio.run(main())


def test_a_request_waits_for_a_starting_or_busy_replica() -> None:
    async def main() -> None:
        clock = Clock()
        pool = make_pool(clock, ["loading", "unreachable"])  # one warming up, one lost
        waiting = lease(pool, "a")
        waiting.enqueue()  # queued: no room yet, but a replica is coming
        assert len(pool.queue) == 1
        pool.views["http://w0"].state = "ready"
        pool.controller.kick()
        await asyncio.wait_for(waiting.wait(), 1)
        assert waiting.granted and waiting.worker is pool.views["http://w0"]
        behind = lease(pool, "b")
        behind.enqueue()  # the ready replica is busy: a busy replica is live, so it waits
        pool.controller.kick()
        assert len(pool.queue) == 1
        waiting.release(served=True)
        await asyncio.wait_for(behind.wait(), 1)
        behind.release(served=True)

    asyncio.run(main())


def test_a_gateway_that_has_not_polled_yet_queues_instead_of_refusing() -> None:
    async def main() -> None:
        pool = Pool("small", ["http://w0"], None, QueueConfig(), 1)  # type: ignore[arg-type]
        assert pool.views["http://w0"].state == "loading"  # members join loading
        first = lease(pool, "a")
        first.enqueue()
        assert len(pool.queue) == 1
        first.release(served=False)

    asyncio.run(main())


def test_requests_waiting_when_the_last_live_replica_goes_are_refused_at_the_next_poll() -> None:
    async def main() -> None:
        clock = Clock()
        pool = make_pool(clock, ["ready", "loading"])
        holder = lease(pool, "a")
        holder.enqueue()
        await holder.wait()
        queued = [lease(pool, r) for r in "bc"]
        waits = []
        for q in queued:
            q.enqueue()
            waits.append(asyncio.ensure_future(q.wait()))
        pool.views["http://w0"].state = "unreachable"
        pool.controller.kick()  # w1 is still loading: they keep waiting
        await asyncio.sleep(0)
        assert not any(w.done() for w in waits) and len(pool.queue) == 2
        pool.views["http://w1"].state = "draining"
        pool.controller.kick()  # what a load poll does after refreshing the views
        for w in waits:
            with pytest.raises(NoReplica):
                await asyncio.wait_for(w, 1)
        assert len(pool.queue) == 0
        for q in queued:
            q.release(served=False)
        holder.release(served=False)
        assert pool.controller.num_dispatched == 0 and pool.views["http://w0"].inflight == 0

    asyncio.run(main())


def test_a_member_silent_since_it_joined_is_starting_only_for_the_grace() -> None:
    async def main() -> None:
        clock = Clock()
        pool = Pool("small", [], None, QueueConfig(), 1, clock=clock, start_grace_s=30.0)  # type: ignore[arg-type]
        pool.add_member("http://w0")
        pool.views["http://w0"].state = "unreachable"  # its first poll: not listening yet
        waiting = lease(pool, "a")
        waiting.enqueue()
        wait = asyncio.ensure_future(waiting.wait())
        clock.now += 29.0
        pool.controller.kick()
        await asyncio.sleep(0)
        assert not wait.done()
        clock.now += 2.0  # past the grace and still silent: lost
        pool.controller.kick()
        with pytest.raises(NoReplica):
            await asyncio.wait_for(wait, 1)
        waiting.release(served=False)

    asyncio.run(main())
