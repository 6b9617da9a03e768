"""The counting pool: work that grows with a prompt runs on threads, at most `per_tenant` of a
tenant's at a time, the rest in the tenant's own lane, lanes served round-robin; a caller
that leaves does not free its place before its work ends; a full lane is a 429."""

import asyncio
import threading

import pytest

from gateway.serving.counting import CountingPool
from tests.support.waiting import settles
from workers.api.types import ApiError


class Work:
    """A job that runs on a pool thread until released, recording that it started."""

    def __init__(self, name: str, started: list[str]) -> None:
        self.name, self.started = name, started
        self.release = threading.Event()

    def __call__(self) -> str:
        self.started.append(self.name)
        assert self.release.wait(10), f"{self.name} never released"
        return self.name


async def until(predicate) -> None:  # noqa: ANN001
    """Wait for a worker thread's effect on the loop (no clock: loop passes, then a yield
    to the threads)."""
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never true: {predicate}")


def test_a_tenants_counts_wait_in_its_lane_while_another_tenants_run() -> None:
    async def main() -> None:
        pool = CountingPool(num_threads=2, per_tenant=1)
        started: list[str] = []
        a1, a2, b1 = Work("a1", started), Work("a2", started), Work("b1", started)
        runs = [asyncio.ensure_future(pool.run("a", a1))]
        await until(lambda: started == ["a1"])
        runs.append(asyncio.ensure_future(pool.run("a", a2)))
        await settles(lambda: pool.waiting == 1)
        runs.append(asyncio.ensure_future(pool.run("b", b1)))
        await until(lambda: started == ["a1", "b1"])  # b went past a's second count
        assert pool.running == {"a": 1, "b": 1} and pool.waiting == 1
        b1.release.set()
        assert await runs[2] == "b1"
        await settles(lambda: pool.running == {"a": 1})  # a free thread, but a has its one
        assert started == ["a1", "b1"]
        a1.release.set()
        await until(lambda: started == ["a1", "b1", "a2"])
        a2.release.set()
        assert await asyncio.gather(*runs[:2]) == ["a1", "a2"]
        await settles(lambda: pool.running == {} and pool.waiting == 0)
        pool.close()

    asyncio.run(main())


def test_lanes_are_served_round_robin_as_threads_free() -> None:
    async def main() -> None:
        pool = CountingPool(num_threads=1, per_tenant=1)
        started: list[str] = []
        holder = Work("hold", started)
        first = asyncio.ensure_future(pool.run("x", holder))
        await until(lambda: started == ["hold"])
        jobs = {}
        for name in ("a1", "a2", "a3", "b1", "b2"):
            jobs[name] = Work(name, started)
            jobs[name].release.set()
        runs = [asyncio.ensure_future(pool.run(n[0], jobs[n])) for n in jobs]
        await settles(lambda: pool.waiting == 5)
        holder.release.set()
        await asyncio.gather(first, *runs)
        assert started == ["hold", "a1", "b1", "a2", "b2", "a3"]
        pool.close()

    asyncio.run(main())


def test_a_caller_that_leaves_keeps_its_place_until_its_work_ends() -> None:
    async def main() -> None:
        pool = CountingPool(num_threads=2, per_tenant=1)
        started: list[str] = []
        a1, a2 = Work("a1", started), Work("a2", started)
        run = asyncio.ensure_future(pool.run("a", a1))
        await until(lambda: started == ["a1"])
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert pool.running == {"a": 1}  # its work still holds a thread
        second = asyncio.ensure_future(pool.run("a", a2))
        await settles(lambda: pool.waiting == 1)
        assert started == ["a1"]
        a1.release.set()
        await until(lambda: started == ["a1", "a2"])
        a2.release.set()
        assert await second == "a2"
        await settles(lambda: pool.running == {})
        pool.close()

    asyncio.run(main())


def test_a_waiter_that_leaves_its_lane_takes_nothing() -> None:
    async def main() -> None:
        pool = CountingPool(num_threads=1, per_tenant=1)
        started: list[str] = []
        a1, a2, b1 = Work("a1", started), Work("a2", started), Work("b1", started)
        first = asyncio.ensure_future(pool.run("a", a1))
        await until(lambda: started == ["a1"])
        left = asyncio.ensure_future(pool.run("a", a2))
        await settles(lambda: pool.waiting == 1)
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        assert pool.waiting == 0
        b1.release.set()
        other = asyncio.ensure_future(pool.run("b", b1))
        a1.release.set()
        assert await asyncio.gather(first, other) == ["a1", "b1"]
        assert started == ["a1", "b1"]
        pool.close()

    asyncio.run(main())


def test_a_full_lane_is_refused_with_429_and_errors_reach_the_caller() -> None:
    async def main() -> None:
        pool = CountingPool(num_threads=1, per_tenant=1, lane_max=1)
        started: list[str] = []
        a1, a2 = Work("a1", started), Work("a2", started)
        first = asyncio.ensure_future(pool.run("a", a1))
        await until(lambda: started == ["a1"])
        second = asyncio.ensure_future(pool.run("a", a2))
        await settles(lambda: pool.waiting == 1)
        with pytest.raises(ApiError) as refused:
            await pool.run("a", Work("a3", started))
        err = refused.value
        assert err.status == 429 and err.code == "gateway_busy" and err.retry_after_s >= 1
        a1.release.set()
        a2.release.set()
        await asyncio.gather(first, second)

        def fails() -> int:
            raise ApiError(400, "cannot render the chat template", param="messages")

        with pytest.raises(ApiError) as failed:
            await pool.run("a", fails)
        assert failed.value.status == 400
        await settles(lambda: pool.running == {})
        pool.close()

    asyncio.run(main())
