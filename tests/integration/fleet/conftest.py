"""One real Redis server per module for the fleet tests; a flushed database per test."""

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import redis.asyncio

from tests.support.redis_server import redis_url
from workers.fleet.coordination import FleetStore


@pytest.fixture(scope="module")
def redis_server_url() -> Iterator[str]:
    with redis_url() as url:
        yield url


@pytest_asyncio.fixture
async def store(redis_server_url: str) -> AsyncIterator[FleetStore]:
    client = redis.asyncio.Redis.from_url(redis_server_url)
    await client.flushdb()
    try:
        yield FleetStore(client)
    finally:
        await client.aclose()
