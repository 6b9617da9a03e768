"""The door: shares of admissions (pure, fake clock), the gate that holds the tenants over
their share by the others' latency (one event loop, fake clock, ticks driven by hand), and
the loop monitor (a real event loop, blocked on purpose)."""

import asyncio
import time

from gateway.capacity.door import Gate, LoopMonitor, Shares


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- shares -----------------------------------------------------------------------------


def test_one_tenant_alone_is_never_over_its_share() -> None:
    shares = Shares(1.0, Clock())
    for _ in range(100):
        shares.count("heavy")
    assert shares.share() is None and not shares.over_share("heavy")


def test_the_tenant_admitted_more_than_an_equal_share_is_over_it() -> None:
    shares = Shares(1.0, Clock())
    for _ in range(9):
        shares.count("heavy")
    shares.count("light")
    assert shares.share() == 5.0
    assert shares.over_share("heavy") and not shares.over_share("light")


def test_a_tenant_that_only_asked_is_active_and_splits_the_share() -> None:
    shares = Shares(1.0, Clock())
    for _ in range(4):
        shares.count("heavy")
    assert not shares.over_share("heavy")
    shares.asked("light")
    assert shares.active_tenants() == 2 and shares.over_share("heavy")


def test_admissions_and_idle_tenants_leave_with_the_window() -> None:
    clock = Clock()
    shares = Shares(1.0, clock)
    shares.count("light")
    for _ in range(10):
        shares.count("heavy")
    assert shares.over_share("heavy")
    clock.now = 1.5
    assert shares.active_tenants() == 0 and shares.share() is None
    shares.count("heavy")
    assert not shares.over_share("heavy")  # alone again


# -- the gate ---------------------------------------------------------------------------


def make_gate(**kw) -> tuple[Gate, Clock]:  # noqa: ANN003
    clock = Clock()
    kw.setdefault("tolerance_s", 0.001)
    return Gate(clock=clock, window_s=10.0, **kw), clock


def flood_then_light(gate: Gate) -> None:
    """heavy admitted 9 times and light once: heavy is over its share."""
    for _ in range(9):
        gate.shares.count("heavy")
    gate.shares.count("light")


async def until(condition) -> None:  # noqa: ANN001
    """Yield to the event loop until `condition()` holds (no clock: loop turns only)."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def suffer(gate: Gate, ticks: int = 1) -> None:
    """The light tenant's latency well over the floor, for `ticks` ticks."""
    gate.observe("light", 0.001)  # the floor
    for _ in range(ticks):
        gate.observe("light", 0.050)
        gate.tick()


def test_a_tenant_alone_is_never_held_however_the_latency() -> None:
    async def main() -> None:
        gate, _ = make_gate()
        gate.observe("heavy", 0.001)
        gate.observe("heavy", 0.5)
        gate.tick()
        assert all([await gate.enter("heavy") for _ in range(200)])
        assert gate.in_flight == {"heavy": 200} and gate.waiting == 0

    asyncio.run(main())


def test_while_the_light_tenant_suffers_the_limit_halves_and_the_flood_waits_in_its_lane() -> None:
    async def main() -> None:
        gate, _ = make_gate()
        flood_then_light(gate)
        for _ in range(8):
            assert await gate.enter("heavy")  # the limit starts high
        suffer(gate)
        assert gate.limit == 4.0  # half of what heavy has in flight
        waiting = [asyncio.ensure_future(gate.enter("heavy")) for _ in range(3)]
        await until(lambda: gate.waiting == 3)
        assert not any(w.done() for w in waiting)
        assert await gate.enter("light")  # under its share: straight in
        for _ in range(5):
            gate.leave("heavy")  # 8 -> 3 in flight: one place under the limit of 4
        assert gate.waiting == 2 and gate.in_flight == {"heavy": 4, "light": 1}
        await until(lambda: waiting[0].done())
        assert waiting[0].result() is True and not any(w.done() for w in waiting[1:])
        for w in waiting[1:]:
            w.cancel()

    asyncio.run(main())


def test_the_limit_grows_back_once_the_latency_is_within_tolerance() -> None:
    async def main() -> None:
        gate, _ = make_gate()
        flood_then_light(gate)
        for _ in range(4):
            assert await gate.enter("heavy")
        suffer(gate, ticks=3)
        assert gate.limit == 1.0  # 4 -> 2 -> 1, never below 1
        waiter = asyncio.ensure_future(gate.enter("heavy"))
        await until(lambda: gate.waiting == 1)
        for _ in range(20):
            gate.observe("light", 0.0015)  # within floor + 1 ms
        for _ in range(4):
            gate.tick()
        assert gate.limit == 5.0  # +1 a tick while someone waits
        await until(waiter.done)
        assert waiter.result() is True

    asyncio.run(main())


def test_lanes_are_served_round_robin() -> None:
    async def main() -> None:
        gate, _ = make_gate()
        for tenant in ("a", "b"):
            for _ in range(9):
                gate.shares.count(tenant)
        gate.shares.count("light")
        assert await gate.enter("a")
        suffer(gate)
        assert gate.limit == 1.0
        order: list[str] = []

        async def one(tenant: str) -> None:
            assert await gate.enter(tenant)
            order.append(tenant)

        tasks = [asyncio.ensure_future(one(t)) for t in ("a", "a", "a", "b", "b")]
        await until(lambda: gate.waiting == 5)
        for served in range(5):
            gate.leave(order[-1] if order else "a")  # the one in flight leaves
            await until(lambda n=served: len(order) == n + 1)
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "a", "b", "a"]

    asyncio.run(main())


def test_a_request_that_waits_too_long_or_finds_its_lane_full_is_refused() -> None:
    async def main() -> None:
        gate, _ = make_gate(max_wait_s=0.05, lane_max=2)
        flood_then_light(gate)
        assert await gate.enter("heavy")
        suffer(gate)
        assert gate.limit == 1.0
        waiting = [asyncio.ensure_future(gate.enter("heavy")) for _ in range(2)]
        await until(lambda: gate.waiting == 2)
        assert await gate.enter("heavy") is False  # the lane holds 2
        assert await asyncio.gather(*waiting) == [False, False]  # waited 50 ms
        assert gate.waiting == 0 and gate.in_flight == {"heavy": 1}  # nothing leaked

    asyncio.run(main())


def test_the_loop_monitor_sees_a_blocked_loop() -> None:
    seen: list[float] = []

    async def main() -> None:
        monitor = LoopMonitor(interval_s=0.01, smoothing=1.0, on_tick=seen.append)
        monitor.start()
        try:
            while len(seen) < 3:
                await asyncio.sleep(0.005)
            time.sleep(0.1)  # the loop is blocked: the monitor's timer fires late
            n = len(seen)
            while len(seen) == n:
                await asyncio.sleep(0.005)
        finally:
            monitor.stop()

    asyncio.run(main())
    assert seen[-1] > 0.05 > min(seen[:3])
