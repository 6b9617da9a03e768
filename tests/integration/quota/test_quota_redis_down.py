"""What the quota package does when Redis is unreachable: per limit class fail open or closed,
counted in metrics, logged once per episode; key lookup never fails open."""

import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from quota.errors import QuotaUnavailable
from quota.limiter import FailurePolicy, QuotaLimiter
from quota.models import Tenant, TenantLimits
from quota.store import TenantStore
from tests.support.redis_server import embedded_redis

pytestmark = pytest.mark.asyncio

METRIC = "switchyard_gateway_quota_redis_errors_total"


def fail_fast(**kwargs) -> redis.asyncio.Redis:
    return redis.asyncio.Redis(retry=Retry(NoBackoff(), 0), socket_connect_timeout=0.5, **kwargs)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: nothing listens there


@pytest_asyncio.fixture
async def dead_redis() -> AsyncIterator[redis.asyncio.Redis]:
    client = fail_fast(host="127.0.0.1", port=closed_port())
    yield client
    await client.aclose()


def errors(registry: CollectorRegistry, limit_class: str, decision: str) -> float:
    value = registry.get_sample_value(METRIC, {"limit_class": limit_class, "decision": decision})
    return value or 0.0


LIMITED = Tenant("acme", "Acme", TenantLimits(tokens_per_minute=100, max_concurrent=1), [])


async def test_fail_open_admits_unchecked_and_counts_each_class(
    dead_redis: redis.asyncio.Redis,
) -> None:
    registry = CollectorRegistry()
    limiter = QuotaLimiter(dead_redis, registry=registry)
    for i in range(3):  # over every limit, yet admitted: nothing can be checked
        reservation, state = await limiter.reserve(LIMITED, f"r{i}", 1000)
        assert reservation.checked is False
        assert state.limit_tokens is None and state.remaining_requests is None
    assert errors(registry, "tokens", "open") == 3
    assert errors(registry, "requests", "open") == 3
    assert errors(registry, "concurrency", "open") == 3
    assert errors(registry, "tokens", "closed") == 0

    await limiter.reconcile(reservation, 10)  # never raises
    assert registry.get_sample_value("switchyard_gateway_quota_reconcile_errors_total") == 1


async def test_fail_closed_refuses_with_a_short_retry_after(
    dead_redis: redis.asyncio.Redis,
) -> None:
    registry = CollectorRegistry()
    limiter = QuotaLimiter(dead_redis, FailurePolicy(tokens="closed"), registry)
    with pytest.raises(QuotaUnavailable) as err:
        await limiter.reserve(LIMITED, "r1", 10)
    assert 1.0 <= err.value.retry_after_s <= 2.0
    assert err.value.limit_class == "tokens"
    assert errors(registry, "tokens", "closed") == 1
    assert errors(registry, "concurrency", "open") == 1


async def test_fail_closed_class_without_a_limit_for_the_tenant_stays_open(
    dead_redis: redis.asyncio.Redis,
) -> None:
    registry = CollectorRegistry()
    policy = FailurePolicy(tokens="closed", requests="closed", concurrency="closed")
    limiter = QuotaLimiter(dead_redis, policy, registry)
    unlimited = Tenant("free", "Free", TenantLimits(), [])
    reservation, _ = await limiter.reserve(unlimited, "r1", 10)
    assert reservation.checked is False
    assert errors(registry, "tokens", "open") == 1
    assert errors(registry, "concurrency", "open") == 0  # no max_concurrent: not tracked

    only_concurrency = Tenant("c", "C", TenantLimits(max_concurrent=3), [])
    with pytest.raises(QuotaUnavailable) as err:
        await limiter.reserve(only_concurrency, "r2", 10)
    assert err.value.limit_class == "concurrency"


async def test_key_lookup_never_fails_open(dead_redis: redis.asyncio.Redis) -> None:
    store = TenantStore(dead_redis)
    with pytest.raises(QuotaUnavailable):
        await store.authenticate("sy-ab12cd34-" + "x" * 43)


async def test_outage_is_logged_once_and_recovery_restores_checking(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    socket_path = tmp_path / "redis.sock"
    client = fail_fast(unix_socket_path=str(socket_path))
    limiter = QuotaLimiter(client)
    caplog.set_level(logging.INFO, logger="quota.limiter")
    try:
        down = [(await limiter.reserve(LIMITED, f"d{i}", 10))[0] for i in range(3)]
        assert [r.checked for r in down] == [False] * 3
        assert [r.levelname for r in caplog.records] == ["WARNING"]

        with embedded_redis(socket_path):
            up, _ = await limiter.reserve(LIMITED, "u1", 10)
            assert up.checked is True
            assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
            # Usage during the outage is charged at reconcile, not lost.
            await limiter.reconcile(down[0], 40)
            await limiter.reconcile(down[0], 40)  # still only once
            assert (await limiter.usage("acme"))["tokens_this_minute"] == 50
            await client.aclose()  # before the server goes
    finally:
        await client.aclose()
