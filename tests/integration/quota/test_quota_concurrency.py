"""Exactness under contention: several OS processes, each with hundreds of concurrent reserves
against one tenant, never admit more than the limit, and admit exactly as much as fits."""

import asyncio
import multiprocessing
import time

import redis
import redis.asyncio

from quota import keyspace
from quota.errors import QuotaExceeded
from quota.limiter import QuotaLimiter
from quota.models import Tenant, TenantLimits
from quota.policy import MINUTE_S, seconds_to_window_end

NUM_PROCESSES = 2
CALLS_PER_PROCESS = 300
TOKENS_PER_MINUTE = 1000
COST = 7
BURST_MARGIN_S = 5.0  # start the burst only if the minute has this much left


async def _reserve_many(url: str, tenant: Tenant, name: str) -> list[tuple[int, int]]:
    pool = redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=32)
    client = redis.asyncio.Redis(connection_pool=pool)
    limiter = QuotaLimiter(client)

    async def one(i: int) -> tuple[int, int] | None:
        try:
            reservation, _ = await limiter.reserve(tenant, f"{name}-{i}", COST)
        except QuotaExceeded:
            return None
        return reservation.minute, reservation.tokens

    try:
        results = await asyncio.gather(*(one(i) for i in range(CALLS_PER_PROCESS)))
    finally:
        await client.aclose()
        await pool.aclose()
    return [r for r in results if r is not None]


def _burst(url: str, tenant: Tenant, name: str, ready, go, results) -> None:
    ready.wait(timeout=60)
    go.wait(timeout=60)
    results.put((name, asyncio.run(_reserve_many(url, tenant, name))))


def test_processes_racing_on_one_tenant_admit_exactly_what_fits(redis_server_url: str) -> None:
    sync = redis.Redis.from_url(redis_server_url)
    sync.flushdb()
    tenant = Tenant("race", "Race", TenantLimits(tokens_per_minute=TOKENS_PER_MINUTE), [])
    ctx = multiprocessing.get_context("spawn")
    ready, go, results = ctx.Barrier(NUM_PROCESSES + 1), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_burst, args=(redis_server_url, tenant, f"p{i}", ready, go, results))
        for i in range(NUM_PROCESSES)
    ]
    for p in procs:
        p.start()
    try:
        ready.wait(timeout=60)  # every process has started and imported what it needs
        sec, usec = sync.time()
        left_s = seconds_to_window_end(sec + usec / 1e6, MINUTE_S)
        if left_s < BURST_MARGIN_S:  # keep the burst inside one minute window
            time.sleep(left_s + 0.05)
        go.set()
        per_process = dict(results.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    admitted = [r for rs in per_process.values() for r in rs]
    charged = sync.get(keyspace.tokens_minute("race", admitted[0][0]))
    sync.close()

    assert {minute for minute, _ in admitted} == {admitted[0][0]}, "burst crossed a minute"
    assert sum(tokens for _, tokens in admitted) <= TOKENS_PER_MINUTE
    assert len(admitted) == TOKENS_PER_MINUTE // COST
    assert int(charged) == len(admitted) * COST
    assert all(p.exitcode == 0 for p in procs)
