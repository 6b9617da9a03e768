"""Accounting that survives faults, against a real Redis that is stopped and started: reconciles
Redis missed and requests admitted unchecked are journaled and applied once it is back; a dead
gateway's reservations are settled by another one's sweep, once, even with sweepers racing."""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio
from prometheus_client import CollectorRegistry

from quota import keyspace
from quota.connection import make_redis
from quota.errors import QuotaExceeded
from quota.journal import ReconcileJournal, Settlement, journal_path
from quota.limiter import QuotaLimiter, Reservation
from quota.models import Tenant, TenantLimits
from quota.sweeper import QuotaMaintenance
from tests.support.redis_server import RestartableRedis, restartable_redis

pytestmark = pytest.mark.asyncio

TTL_S = 0.3  # heartbeat TTL: a dead owner is noticed this fast
TENANT = Tenant("acme", "Acme", TenantLimits(tokens_per_minute=10_000, max_concurrent=2), [])


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def server() -> Iterator[RestartableRedis]:
    with restartable_redis() as srv:
        yield srv


@pytest_asyncio.fixture
async def client(server: RestartableRedis) -> AsyncIterator[redis.asyncio.Redis]:
    if not server.running:  # a failed test may have left it down
        server.start()
    c = make_redis(server.unix_url, connect_timeout_s=0.2, socket_timeout_s=0.5)
    await c.flushdb()
    yield c
    await c.aclose()


class Gateway:
    """What one gateway process holds of the quota package."""

    def __init__(self, client: redis.asyncio.Redis, data_dir: Path, owner_id: str) -> None:
        self.registry = CollectorRegistry()
        self.clock = FakeClock()
        self.journal = ReconcileJournal(journal_path(data_dir, owner_id))
        self.limiter = QuotaLimiter(
            client, registry=self.registry, owner_id=owner_id, journal=self.journal
        )
        self.maintenance = QuotaMaintenance(
            self.limiter, heartbeat_ttl_s=TTL_S, registry=self.registry, clock=self.clock
        )

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def usage(limiter: QuotaLimiter) -> tuple[int, int]:
    u = await limiter.usage("acme")
    return u["tokens_today"], u["concurrent_requests"]


async def test_reconcile_during_an_outage_is_applied_once_when_redis_is_back(
    server: RestartableRedis, client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    gw = Gateway(client, tmp_path, "gw-a")
    reservation, _ = await gw.limiter.reserve(TENANT, "r1", 100)
    server.stop()
    await gw.limiter.reconcile(reservation, 30)  # never raises; journaled
    assert reservation.reconciled and len(gw.journal) == 1
    assert (await gw.maintenance.sweep()).redis_down
    assert gw.metric("switchyard_gateway_quota_journaled_total", kind="checked") == 1

    server.start()
    assert (await gw.maintenance.sweep()).replayed == 1
    assert await usage(gw.limiter) == (30, 0)  # corrected to actual, slot released
    assert len(gw.journal) == 0
    assert (await gw.maintenance.sweep()).replayed == 0
    # Replaying the same settlement again (say the done line was lost) changes nothing.
    settlement = Settlement("acme", "r1", True, reservation.minute, reservation.day, -70, "gw-a")
    assert await gw.limiter.scripts.settle(settlement) is False
    assert await usage(gw.limiter) == (30, 0)


async def test_fail_open_request_is_charged_once_redis_is_back(
    server: RestartableRedis, client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    gw = Gateway(client, tmp_path, "gw-a")
    server.stop()
    reservation, _ = await gw.limiter.reserve(TENANT, "u1", 100)
    assert reservation.checked is False
    await gw.limiter.reconcile(reservation, 40)
    server.start()
    assert (await gw.maintenance.sweep()).replayed == 1
    assert await usage(gw.limiter) == (40, 0)
    await gw.maintenance.sweep()
    await gw.limiter.reconcile(Reservation("acme", "u1", 100, checked=False), 40)  # a copy
    assert await usage(gw.limiter) == (40, 0)


async def test_a_dead_process_journal_is_adopted_and_its_open_requests_charged(
    server: RestartableRedis, client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    dead = Gateway(client, tmp_path, "gw-dead")
    server.stop()
    await dead.limiter.reserve(TENANT, "u1", 100)  # admitted unchecked; never reconciled
    finished, _ = await dead.limiter.reserve(TENANT, "u2", 100)
    await dead.limiter.reconcile(finished, 25)
    dead.journal.close()  # the process dies: its lock goes with it
    server.start()

    heir = Gateway(client, tmp_path, "gw-heir")
    report = await heir.maintenance.sweep()
    assert (report.adopted, report.replayed) == (2, 0)
    assert await usage(heir.limiter) == (125, 0)  # u1: all it could have used; u2: actual
    assert not journal_path(tmp_path, "gw-dead").exists()
    assert heir.metric("switchyard_gateway_quota_journal_applied_total", source="adopted") == 2


async def test_dead_owner_slots_are_released_by_another_owners_sweep(
    client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    a, b = Gateway(client, tmp_path, "gw-a"), Gateway(client, tmp_path, "gw-b")
    assert await a.maintenance.heartbeat()
    held, _ = await a.limiter.reserve(TENANT, "a1", 100)
    await a.limiter.reserve(TENANT, "a2", 50)
    with pytest.raises(QuotaExceeded):
        await b.limiter.reserve(TENANT, "b1", 10)

    await b.maintenance.sweep()  # b has only just seen Redis: sweeps nobody yet
    b.clock.now += TTL_S + 0.01
    assert (await b.maintenance.sweep()).swept == 0  # a is alive

    # a stops beating (SIGKILL); its heartbeat key expires on the server clock.
    await wait_until(lambda: _gone(client, keyspace.owner_heartbeat("gw-a")))
    assert (await b.maintenance.sweep()).swept == 2
    assert await usage(b.limiter) == (150, 0)  # slots free, reservations kept charged
    assert await client.zcard(keyspace.owner_pending("gw-a")) == 0
    await b.limiter.reserve(TENANT, "b1", 10)
    assert b.metric("switchyard_gateway_quota_swept_total") == 2

    # a was only paused: its late reconcile still corrects the charge, once.
    await a.limiter.reconcile(held, 30)
    await a.limiter.reconcile(Reservation(**{**held.__dict__, "reconciled": False}), 30)
    assert await usage(b.limiter) == (90, 1)


async def test_after_an_outage_nobody_is_swept_before_live_owners_could_beat_again(
    client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    a, b = Gateway(client, tmp_path, "gw-a"), Gateway(client, tmp_path, "gw-b")
    await a.maintenance.heartbeat()
    await a.limiter.reserve(TENANT, "a1", 100)
    await client.delete(keyspace.owner_heartbeat("gw-a"))  # lapsed during an outage
    assert (await b.maintenance.sweep()).swept == 0  # b only just reached Redis
    assert await usage(b.limiter) == (100, 1)
    b.clock.now += TTL_S + 0.01
    assert (await b.maintenance.sweep()).swept == 1


async def test_racing_sweepers_settle_each_reservation_once(
    server: RestartableRedis, client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    tenant = Tenant("acme", "Acme", TenantLimits(max_concurrent=100), [])
    dead = Gateway(client, tmp_path, "gw-dead")
    await dead.maintenance.heartbeat()
    for i in range(60):
        await dead.limiter.reserve(tenant, f"d{i}", 10)
    await client.delete(keyspace.owner_heartbeat("gw-dead"))  # its TTL ran out

    sweepers = []
    for name in ("gw-b", "gw-c", "gw-d"):
        other = make_redis(server.unix_url)  # each on its own connections
        gw = Gateway(other, tmp_path, name)
        await gw.maintenance.heartbeat()
        gw.clock.now += TTL_S + 0.01
        sweepers.append((gw, other))
    reports = await asyncio.gather(*(gw.maintenance.sweep() for gw, _ in sweepers))
    for _, other in sweepers:
        await other.aclose()
    assert sum(r.swept for r in reports) == 60
    assert await usage(dead.limiter) == (600, 0)


async def test_a_dead_owners_slot_frees_within_ttl_plus_interval(
    client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    a, b = Gateway(client, tmp_path, "gw-a"), Gateway(client, tmp_path, "gw-b")
    b.maintenance._clock = time.time  # real time: this test runs the loops as deployed
    assert await a.maintenance.heartbeat()
    await a.limiter.reserve(TENANT, "a1", 100)
    stop = asyncio.Event()
    interval_s = 0.05
    loop = asyncio.create_task(b.maintenance.run_forever(interval_s, stop))
    started = time.monotonic()
    try:
        await wait_until(lambda: _released(b.limiter))
    finally:
        stop.set()
        await loop
    assert time.monotonic() - started < TTL_S + interval_s + 0.5
    assert await client.exists(keyspace.owner_heartbeat("gw-b"))  # b kept beating


async def test_close_applies_the_journal_and_drops_the_heartbeat(
    server: RestartableRedis, client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    gw = Gateway(client, tmp_path, "gw-a")
    await gw.maintenance.heartbeat()
    reservation, _ = await gw.limiter.reserve(TENANT, "r1", 100)
    server.stop()
    await gw.limiter.reconcile(reservation, 0)
    server.start()
    await gw.maintenance.close()
    assert await usage(gw.limiter) == (0, 0)
    assert not await client.exists(keyspace.owner_heartbeat("gw-a"))
    assert not gw.journal.path.exists()


async def _gone(client: redis.asyncio.Redis, key: str) -> bool:
    return not await client.exists(key)


async def _released(limiter: QuotaLimiter) -> bool:
    return (await usage(limiter))[1] == 0
