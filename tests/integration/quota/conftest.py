"""Fixtures for the quota integration tests: one real Redis server per session, a flushed
database and a fresh async client per test."""

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import redis.asyncio

from tests.support.redis_server import redis_url


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    with redis_url() as url:
        yield url


@pytest_asyncio.fixture
async def redis_client(redis_server_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_server_url)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()
