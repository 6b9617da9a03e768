"""A Redis restart under a live client from `quota.connection.make_redis`: the pool notices
its dead connections and reconnects by itself, so no call after the restart fails, not even
the first; and the client built the old way (retry given to Redis() beside its own pool) is
shown to lose calls, so the test tells the two apart. The quota scripts heal the same way on
`quota.pipelined.PipelinedRedis`, the one connection the gateway runs them on."""

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from quota.connection import make_redis
from quota.limiter import QuotaLimiter
from quota.models import TenantLimits
from quota.pipelined import PipelinedRedis
from quota.store import TenantStore
from tests.support.redis_server import RestartableRedis, restartable_redis

pytestmark = pytest.mark.asyncio

NUM_CALLS = 20
CONCURRENCY = 8  # calls in flight at once: several pooled connections go stale together


@pytest.fixture(scope="module")
def server() -> Iterator[RestartableRedis]:
    with restartable_redis() as srv:
        yield srv


async def authenticate_and_reserve(
    store: TenantStore, limiter: QuotaLimiter, key: str, rid: str
) -> None:
    found = await store.authenticate(key)
    assert found is not None, "the key must survive the restart"
    reservation, _ = await limiter.reserve(found[1], rid, 10)
    assert reservation.checked, "reserved while Redis was unreachable"
    await limiter.reconcile(reservation, 5)


async def burst(store: TenantStore, limiter: QuotaLimiter, key: str, tag: str) -> list:
    calls = [authenticate_and_reserve(store, limiter, key, f"{tag}-{i}") for i in range(NUM_CALLS)]
    sem = asyncio.Semaphore(CONCURRENCY)

    async def limited(call):  # noqa: ANN001, ANN202
        async with sem:
            return await call

    return await asyncio.gather(*(limited(c) for c in calls), return_exceptions=True)


@pytest.mark.parametrize("scripts_on", ["pool", "pipelined"])
@pytest.mark.parametrize("scheme", ["unix", "tcp"])
async def test_every_call_after_a_restart_succeeds(
    server: RestartableRedis, scheme: str, scripts_on: str
) -> None:
    url = server.unix_url if scheme == "unix" else server.tcp_url
    # No health checks: the command retry alone must heal the pool.
    client = make_redis(url, max_connections=CONCURRENCY, health_check_interval_s=0)
    # The quota scripts on the pool, or on one pipelined connection as the gateway runs them.
    pipelined = PipelinedRedis(url) if scripts_on == "pipelined" else None
    limiter = QuotaLimiter(client, pipelined=pipelined)
    try:
        await client.flushdb()
        store = TenantStore(client)
        await store.create_tenant("acme", "Acme", TenantLimits(max_concurrent=CONCURRENCY))
        key = (await store.create_key("acme")).plaintext
        await client.save()  # the key is on disk before the server goes

        assert await burst(store, limiter, key, "a") == [None] * NUM_CALLS
        server.restart()
        # The very first call meets a stale pooled connection; the retry reconnects.
        await authenticate_and_reserve(store, limiter, key, "first")
        after = await burst(store, limiter, key, "b")
        assert after == [None] * NUM_CALLS, [r for r in after if r is not None][:3]
        usage = await limiter.usage("acme")
        assert usage["concurrent_requests"] == 0
    finally:
        await limiter.aclose()
        await client.aclose()


async def test_retry_given_beside_an_explicit_pool_is_ignored(server: RestartableRedis) -> None:
    """The configuration the gateway had: the first call after a restart fails."""
    pool = redis.asyncio.BlockingConnectionPool.from_url(server.unix_url, max_connections=1)
    client = redis.asyncio.Redis(
        connection_pool=pool,
        retry=Retry(NoBackoff(), 1),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    try:
        assert await client.ping()
        server.restart()
        with pytest.raises(RedisConnectionError):
            await client.ping()
    finally:
        await client.aclose()
        await pool.aclose()
