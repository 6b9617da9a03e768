"""make_redis puts the retry policy where redis-py reads it: on each pooled connection."""

import pytest
from redis.asyncio.connection import UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from quota.connection import make_redis, retry_bound_s


@pytest.mark.parametrize("url", ["unix:///tmp/sy-none.sock", "redis://127.0.0.1:1/0"])
def test_each_pooled_connection_carries_the_retry_and_health_check(url: str) -> None:
    client = make_redis(url, retries=2, health_check_interval_s=3, connect_timeout_s=0.5)
    conn = client.connection_pool.make_connection()
    assert conn.retry.get_retries() == 2
    assert {RedisConnectionError, RedisTimeoutError} <= set(conn.retry._supported_errors)
    assert conn.health_check_interval == 3
    assert conn.socket_connect_timeout == 0.5
    assert isinstance(conn, UnixDomainSocketConnection) == url.startswith("unix:")


def test_the_retry_bound_is_well_under_a_request_budget() -> None:
    assert retry_bound_s(0, socket_timeout_s=2.0, connect_timeout_s=1.0) == 3.0
    assert retry_bound_s(2, socket_timeout_s=2.0, connect_timeout_s=1.0) < 20.0


def test_negative_retries_are_refused() -> None:
    with pytest.raises(ValueError):
        make_redis("redis://127.0.0.1:1/0", retries=-1)
