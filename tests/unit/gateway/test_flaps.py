"""A member back from a stall rejoins the rotation only after a hold that doubles with
each flap (gateway/capacity/flaps.py), and the pool acts on the held state."""

import asyncio

from gateway.capacity.fair_queue import QueueConfig
from gateway.capacity.flaps import FlapGuard, FlapPolicy
from gateway.capacity.pool import Pool
from workers.api.types import LoadReport

URL = "http://a"


def test_a_recovering_member_is_held_until_it_reports_ready_for_its_hold() -> None:
    guard = FlapGuard(FlapPolicy(hold_s=2.0, max_hold_s=8.0, reset_s=60.0))
    assert guard.state(URL, "ready", 0.0) == "ready"  # never stalled: as reported
    assert guard.state(URL, "stalled", 1.0) == "stalled"
    assert guard.state(URL, "ready", 2.0) == "stalled"
    assert guard.state(URL, "ready", 3.9) == "stalled"
    assert guard.state(URL, "ready", 4.0) == "ready"  # 2 s ready in a row
    assert guard.state(URL, "ready", 4.1) == "ready"


def test_each_flap_doubles_the_hold_up_to_its_cap_and_a_quiet_spell_forgives() -> None:
    guard = FlapGuard(FlapPolicy(hold_s=2.0, max_hold_s=5.0, reset_s=60.0))
    holds = []
    now = 0.0
    for _ in range(4):
        guard.state(URL, "stalled", now)
        holds.append(guard.hold_s(URL))
        now += 1.0
        assert guard.state(URL, "ready", now) == "stalled"
        now += holds[-1]
        assert guard.state(URL, "ready", now) == "ready"
        now += 1.0
    assert holds == [2.0, 4.0, 5.0, 5.0]
    guard.state(URL, "stalled", now + 61.0)  # the last stall was over reset_s ago
    assert guard.hold_s(URL) == 2.0


def test_a_stall_during_the_hold_starts_the_hold_again() -> None:
    guard = FlapGuard(FlapPolicy(hold_s=2.0, max_hold_s=30.0, reset_s=60.0))
    guard.state(URL, "stalled", 0.0)
    guard.state(URL, "ready", 1.0)
    assert guard.state(URL, "stalled", 2.0) == "stalled"  # still the same episode
    assert guard.hold_s(URL) == 2.0
    assert guard.state(URL, "ready", 3.0) == "stalled"
    assert guard.state(URL, "ready", 4.9) == "stalled"
    assert guard.state(URL, "ready", 5.0) == "ready"
    assert guard.state(URL, "unreachable", 6.0) == "unreachable"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Reports:
    """A worker client whose /load says `state`."""

    def __init__(self) -> None:
        self.state = "ready"

    async def load(self, url: str, timeout_s: float = 1.0) -> LoadReport:
        return LoadReport(self.state, 0, 0, 0, 10, 1000, 1000, 0, 0.0, "small", 512)


def polled(pool: Pool, client: Reports, state: str) -> None:
    client.state = state
    asyncio.run(pool.refresh())


def test_the_pool_sends_nothing_to_a_held_member() -> None:
    clock, client = Clock(), Reports()
    pool = Pool(
        "small", [URL], client, QueueConfig(), 4, clock=clock,  # type: ignore[arg-type]
        flap_policy=FlapPolicy(hold_s=3.0),
    )  # fmt: skip
    view = pool.views[URL]
    polled(pool, client, "ready")
    assert pool.has_room()
    polled(pool, client, "stalled")
    assert not pool.has_room() and not pool.has_live_replica()
    clock.now += 1.0
    polled(pool, client, "ready")
    assert view.state == "stalled" and not pool.has_room()
    clock.now += 3.0
    polled(pool, client, "ready")
    assert view.state == "ready" and pool.has_room()
