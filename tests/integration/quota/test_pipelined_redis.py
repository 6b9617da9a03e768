"""`quota.pipelined.PipelinedRedis` against a real Redis: many callers on one connection each
get their own reply, an error reaches only its caller, scripts survive a flush, a timeout or
a restart costs a reconnect and never a misrouted reply, and credentials and db apply."""

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from quota.pipelined import PipelinedRedis
from tests.support.redis_server import RestartableRedis, embedded_redis, restartable_redis
from tests.support.waiting import settles

SCRIPT = "return {KEYS[1], ARGV[1], redis.call('INCR', KEYS[1])}"


@pytest_asyncio.fixture
async def client(redis_client: redis.asyncio.Redis, redis_server_url: str) -> AsyncIterator:
    pipelined = PipelinedRedis(redis_server_url)
    try:
        yield pipelined
    finally:
        await pipelined.aclose()


@pytest.mark.asyncio
async def test_concurrent_callers_get_their_own_replies_on_one_connection(
    client: PipelinedRedis,
) -> None:
    n = 500
    replies = await asyncio.gather(
        *(client.execute("ECHO", f"caller-{i}") for i in range(n)),
        *(client.execute("INCR", "counter") for _ in range(n)),
    )
    assert replies[:n] == [f"caller-{i}".encode() for i in range(n)]
    assert sorted(replies[n:]) == list(range(1, n + 1))
    assert client.connects == 1


@pytest.mark.asyncio
async def test_an_error_reply_fails_only_its_caller(client: PipelinedRedis) -> None:
    replies = await asyncio.gather(
        client.execute("ECHO", "before"),
        client.execute("INCR", "k", "extra-argument"),
        client.execute("ECHO", "after"),
        return_exceptions=True,
    )
    assert replies[0] == b"before" and replies[2] == b"after"
    assert isinstance(replies[1], ResponseError) and "wrong number of arguments" in str(replies[1])
    assert await client.execute("PING") == b"PONG"
    assert client.connects == 1


@pytest.mark.asyncio
async def test_a_closed_client_refuses_at_once(redis_server_url: str) -> None:
    client = PipelinedRedis(redis_server_url, retries=5)
    assert await client.execute("PING") == b"PONG"
    await client.aclose()

    class NoBackoff:
        def compute(self, failures: int) -> float:
            raise AssertionError("a closed client backed off to retry")

    client._backoff = NoBackoff()  # noqa: SLF001
    with pytest.raises(RedisConnectionError, match="closed"):
        await client.execute("PING")


@pytest.mark.asyncio
async def test_a_cancelled_caller_does_not_shift_the_replies(
    client: PipelinedRedis, redis_client: redis.asyncio.Redis
) -> None:
    assert await client.execute("PING") == b"PONG"  # connected
    conn = client._conn  # noqa: SLF001
    # Redis holds every reply until the pause ends: the abandoned one is still to come.
    await redis_client.execute_command("CLIENT", "PAUSE", "300", "ALL")
    first = asyncio.ensure_future(client.execute("ECHO", "abandoned"))
    await settles(lambda: len(conn.waiting) == 1)  # its command is on the connection
    first.cancel()
    assert await client.execute("ECHO", "next") == b"next"
    assert first.cancelled() and client.connects == 1


@pytest.mark.asyncio
async def test_a_script_runs_by_sha_and_survives_a_script_flush(
    client: PipelinedRedis, redis_client: redis.asyncio.Redis
) -> None:
    script = redis_client.register_script(SCRIPT)
    assert await client.run_script(SCRIPT, script.sha, ["k"], ["a"]) == [b"k", b"a", 1]
    assert await redis_client.script_exists(script.sha) == [True]  # EVAL cached it
    await redis_client.script_flush()
    assert await client.run_script(SCRIPT, script.sha, ["k"], ["b"]) == [b"k", b"b", 2]
    with pytest.raises(ResponseError, match="boom"):
        await client.run_script("return redis.error_reply('boom')", "0" * 40, [], [])


@pytest.mark.asyncio
async def test_a_reply_later_than_the_timeout_raises_and_the_next_call_reconnects(
    redis_client: redis.asyncio.Redis, redis_server_url: str
) -> None:
    client = PipelinedRedis(redis_server_url, socket_timeout_s=0.1, retries=0)
    try:
        assert await client.execute("PING") == b"PONG"
        await redis_client.execute_command("CLIENT", "PAUSE", "500", "ALL")
        with pytest.raises(RedisTimeoutError):
            await client.execute("ECHO", "paused")
        client.socket_timeout_s = 10.0  # the next connection waits out the pause
        # A reply to the timed-out command must not be taken for this one's.
        assert await client.execute("ECHO", "resumed") == b"resumed"
        assert client.connects == 2
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_an_unreachable_server_raises_connection_error_after_its_retries(
    tmp_path,  # noqa: ANN001
) -> None:
    client = PipelinedRedis(f"unix://{tmp_path}/nobody.sock", retries=2)
    try:
        with pytest.raises(RedisConnectionError, match="cannot connect"):
            await client.execute("PING")
        assert client.connects == 0
    finally:
        await client.aclose()


def test_one_client_serves_event_loops_in_turn(redis_server_url: str) -> None:
    """A connection belongs to the loop that made it: a caller running `asyncio.run` twice
    gets a fresh one the second time, not a future of a closed loop."""
    client = PipelinedRedis(redis_server_url)
    assert asyncio.run(client.execute("ECHO", "first loop")) == b"first loop"
    assert asyncio.run(client.execute("ECHO", "second loop")) == b"second loop"
    assert client.connects == 2
    asyncio.run(client.aclose())


@pytest.fixture(scope="module")
def server() -> Iterator[RestartableRedis]:
    with restartable_redis() as srv:
        yield srv


@pytest.mark.asyncio
@pytest.mark.parametrize("scheme", ["unix", "tcp"])
async def test_calls_after_a_restart_succeed_on_a_new_connection(
    server: RestartableRedis, scheme: str
) -> None:
    client = PipelinedRedis(server.unix_url if scheme == "unix" else server.tcp_url)
    try:
        assert await client.execute("SET", "k", "v") == b"OK"
        await client.execute("SAVE")
        connects = client.connects
        server.restart()
        # The first call after the restart finds the old socket closed and reconnects.
        assert await asyncio.gather(*(client.execute("GET", "k") for _ in range(8))) == [b"v"] * 8
        assert client.connects == connects + 1
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_a_password_and_a_db_from_the_url_apply() -> None:
    with embedded_redis() as url:
        admin = redis.asyncio.Redis.from_url(url)
        await admin.config_set("requirepass", "s3cret")
        await admin.aclose()
        path = url[len("unix://") :]
        client = PipelinedRedis(f"unix://:s3cret@{path}?db=3")
        wrong = PipelinedRedis(f"unix://:wrong@{path}", retries=0)
        reader = redis.asyncio.Redis.from_url(f"unix://:s3cret@{path}?db=3")
        try:
            assert await client.execute("SET", "where", "db3") == b"OK"
            assert await reader.get("where") == b"db3"
            with pytest.raises(RedisConnectionError, match="refused"):
                await wrong.execute("PING")
        finally:
            await client.aclose()
            await wrong.aclose()
            await reader.aclose()
