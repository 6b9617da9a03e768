"""The door: per-tenant shares of a saturated gateway (pure, fake clock), and the loop
monitor that says when it is saturated (a real event loop, blocked on purpose)."""

import asyncio
import time

from gateway.door import Door, LoopMonitor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_door(saturated: bool = True, window_s: float = 1.0, min_rate: float = 0.0):  # noqa: ANN201
    clock = Clock()
    state = {"saturated": saturated}
    door = Door(lambda: state["saturated"], window_s, clock, min_rate_per_s=min_rate)
    return door, clock, state


def test_one_tenant_alone_is_never_refused_even_saturated() -> None:
    door, _, _ = make_door()
    assert all(door.admit("heavy") for _ in range(1000))


def test_with_spare_cpu_nobody_is_refused() -> None:
    door, _, _ = make_door(saturated=False)
    assert all(door.admit("heavy") for _ in range(100))
    assert door.admit("light")
    assert all(door.admit("heavy") for _ in range(100))


def test_saturated_the_tenant_over_its_share_is_refused_and_the_light_one_passes() -> None:
    door, clock, _ = make_door()
    for _ in range(90):
        assert door.admit("heavy")
        clock.now += 0.001
    assert door.admit("light")
    # 91 admitted in the window, 2 tenants: a share is 45.5; heavy has 90.
    assert not door.admit("heavy")
    assert all(door.admit("light") for _ in range(40))
    assert not door.admit("heavy")


def test_refusals_do_not_count_so_the_shares_even_out_as_the_window_moves() -> None:
    door, clock, _ = make_door(window_s=1.0)
    admitted = {"heavy": 0, "light": 0}
    for step in range(4000):  # 4 s: heavy asks 9 times for each ask of light
        clock.now = step * 0.001
        tenant = "light" if step % 10 == 0 else "heavy"
        admitted[tenant] += door.admit(tenant)
    assert admitted["light"] == 400  # never refused: never over its share
    assert admitted["light"] <= admitted["heavy"] <= admitted["light"] + 20


def test_a_tenant_idle_for_the_window_no_longer_splits_the_share() -> None:
    door, clock, _ = make_door(window_s=1.0)
    door.admit("light")
    for _ in range(10):
        door.admit("heavy")
    assert door.active_tenants() == 2
    clock.now = 1.5
    assert door.active_tenants() == 0
    assert all(door.admit("heavy") for _ in range(50))  # alone again


def test_below_the_minimum_rate_the_lag_is_not_the_requests_doing() -> None:
    door, clock, _ = make_door(window_s=1.0, min_rate=100.0)
    for _ in range(50):
        assert door.admit("heavy")
    assert door.admit("light")
    assert all(door.admit("heavy") for _ in range(49))  # 100 admitted: under 100/s
    assert not door.admit("heavy")


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
