"""Usage records ride on the reconcile (same Lua call): written once per settled request, even
when the reconcile is sent twice, waits in the journal through a Redis outage, or is adopted
from a dead gateway's journal after a restart."""

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio

from quota.connection import make_redis
from quota.journal import ReconcileJournal, journal_path
from quota.limiter import QuotaLimiter
from quota.models import Tenant, TenantLimits
from quota.sweeper import QuotaMaintenance
from quota.usage import UsageConfig, UsagePart, UsageReader, choose_range, usage_record
from tests.support.redis_server import RestartableRedis, restartable_redis

pytestmark = pytest.mark.asyncio

TENANT = Tenant("acme", "Acme", TenantLimits(tokens_per_minute=10_000), [])
CONFIG = UsageConfig(recent_max=3)


@pytest.fixture(scope="module")
def server() -> Iterator[RestartableRedis]:
    with restartable_redis() as srv:
        yield srv


@pytest_asyncio.fixture
async def client(server: RestartableRedis) -> AsyncIterator[redis.asyncio.Redis]:
    if not server.running:
        server.start()
    c = make_redis(server.unix_url, connect_timeout_s=0.2, socket_timeout_s=0.5)
    await c.flushdb()
    yield c
    await c.aclose()


def limiter_for(client, data_dir: Path, owner: str) -> tuple[QuotaLimiter, QuotaMaintenance]:
    journal = ReconcileJournal(journal_path(data_dir, owner))
    limiter = QuotaLimiter(client, owner_id=owner, journal=journal, usage=CONFIG)
    return limiter, QuotaMaintenance(limiter, heartbeat_ttl_s=0.3)


def record(rid: str, key: str = "k1", model: str = "small", status: int = 200, **kw) -> str:
    parts = kw.pop("parts", [UsagePart(model, 10, 4, 5)])
    return usage_record(
        request_id=rid,
        key_id=key,
        model=model,
        route="forced",
        status=status,
        latency_ms=100,
        parts=parts,
        finished_at_s=time.time(),
    )


async def by(reader: UsageReader, group_by: str) -> list[dict]:
    now = time.time()
    return await reader.query(
        "acme", choose_range(now - 3600, now, group_by, now, CONFIG), group_by
    )


async def test_a_reconcile_sent_twice_records_usage_once(client, tmp_path: Path) -> None:
    limiter, _ = limiter_for(client, tmp_path, "gw-a")
    reader = UsageReader(client, CONFIG)
    res, _ = await limiter.reserve(TENANT, "r1", 100)
    usage = record("r1")
    await limiter.reconcile(res, 15, usage)
    res.reconciled = False  # a retry after a lost reply
    await limiter.reconcile(res, 15, usage)
    [row] = await by(reader, "model")
    assert (row["model"], row["requests"], row["prompt_tokens"]) == ("small", 1, 10)
    assert (row["cached_tokens"], row["completion_tokens"], row["total_tokens"]) == (4, 5, 15)
    assert [r["request_id"] for r in await reader.recent("acme")] == ["r1"]


async def test_escalation_parts_count_tokens_per_pool_and_the_request_once(client, tmp_path):
    limiter, _ = limiter_for(client, tmp_path, "gw-a")
    reader = UsageReader(client, CONFIG)
    res, _ = await limiter.reserve(TENANT, "e1", 100)
    parts = [UsagePart("small", 10, 0, 5), UsagePart("large", 10, 2, 7)]
    await limiter.reconcile(res, 32, record("e1", model="large", parts=parts))
    rows = {r["model"]: r for r in await by(reader, "model")}
    assert rows["large"]["requests"] == 1 and rows["small"]["requests"] == 0
    assert (rows["small"]["completion_tokens"], rows["large"]["completion_tokens"]) == (5, 7)


async def test_recent_log_is_capped_and_errors_counted(client, tmp_path: Path) -> None:
    limiter, _ = limiter_for(client, tmp_path, "gw-a")
    reader = UsageReader(client, CONFIG)
    for i in range(5):
        res, _ = await limiter.reserve(TENANT, f"r{i}", 100)
        await limiter.reconcile(res, 0, record(f"r{i}", key=f"k{i % 2}", status=502 if i else 200))
    assert [r["request_id"] for r in await reader.recent("acme")] == ["r4", "r3", "r2"]
    keys = {r["key"]: r for r in await by(reader, "key")}
    assert (keys["k0"]["requests"], keys["k1"]["requests"]) == (3, 2)
    assert sum(r["errors"] for r in keys.values()) == 4


async def test_usage_of_a_reconcile_during_an_outage_is_written_once_redis_is_back(
    server: RestartableRedis, client, tmp_path: Path
) -> None:
    limiter, upkeep = limiter_for(client, tmp_path, "gw-a")
    reader = UsageReader(client, CONFIG)
    res, _ = await limiter.reserve(TENANT, "r1", 100)
    server.stop()
    await limiter.reconcile(res, 15, record("r1"))  # journaled with its usage
    server.start()
    assert (await upkeep.sweep()).replayed == 1
    assert (await upkeep.sweep()).replayed == 0
    [row] = await by(reader, "model")
    assert row["requests"] == 1 and row["total_tokens"] == 15


async def test_usage_journaled_by_a_dead_gateway_is_written_by_the_next_one(
    server: RestartableRedis, client, tmp_path: Path
) -> None:
    dead, _ = limiter_for(client, tmp_path, "gw-dead")
    res, _ = await dead.reserve(TENANT, "r1", 100)
    server.stop()
    await dead.reconcile(res, 15, record("r1"))
    dead.journal.close()  # the process is gone, its journal on disk
    server.start()
    _, heir = limiter_for(client, tmp_path, "gw-heir")
    assert (await heir.sweep()).adopted == 1
    [row] = await by(UsageReader(client, CONFIG), "model")
    assert row["requests"] == 1 and row["total_tokens"] == 15
