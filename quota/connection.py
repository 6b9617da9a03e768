"""The gateway's Redis client: a bounded pool whose connections retry and heal by themselves.

redis-py applies retry settings per connection, from the pool's connection kwargs
(`AbstractConnection.__init__` deep-copies `retry` and extends its errors with
`retry_on_error`; `Redis.execute_command` runs each command through `conn.retry`). A `retry=`
given to `Redis(...)` next to an explicit `connection_pool` is ignored, so a pool built without
them never retries: after a Redis restart every stale pooled connection fails one command.
Here the Retry travels in the pool's kwargs, so a command on a dead connection disconnects,
reconnects and is sent again within the same call.

Every quota script is safe to send twice (reserve and reconcile are idempotent through the
pending marker, unchecked charges through a done marker), so retrying after a timeout cannot
charge a request twice.
"""

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["make_redis", "retry_bound_s"]

RETRY_BASE_S = 0.02  # first backoff up to 2 * base; doubles per failure
RETRY_CAP_S = 0.25  # no single backoff sleeps longer


def make_retry(retries: int) -> Retry:
    """`retries` further attempts after the first, on connection errors and timeouts, with
    exponential backoff and full jitter (so gateways do not reconnect as one wave)."""
    return Retry(
        ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S),
        retries,
        supported_errors=(RedisConnectionError, RedisTimeoutError),
    )


def retry_bound_s(retries: int, socket_timeout_s: float, connect_timeout_s: float) -> float:
    """Upper bound, in seconds, on how long one command can take before it raises while Redis
    is unreachable. redis-py retries the socket connect inside each command attempt with the
    same policy, hence (retries + 1)^2 connects. A refused connection (Redis down or
    restarting) fails in milliseconds; the bound matters only for a silent network."""
    attempts = retries + 1
    backoff_s = sum(min(RETRY_CAP_S, RETRY_BASE_S * 2**i) for i in range(1, attempts))
    per_attempt_s = attempts * connect_timeout_s + backoff_s + socket_timeout_s
    return attempts * per_attempt_s + backoff_s


def make_redis(
    url: str,
    *,
    max_connections: int = 32,
    socket_timeout_s: float = 2.0,
    connect_timeout_s: float = 1.0,
    pool_timeout_s: float = 2.0,
    retries: int = 2,
    health_check_interval_s: int = 5,
) -> redis.asyncio.Redis:
    """A client for `url` (`redis://`, `rediss://` or `unix://`) over a BlockingConnectionPool.

    max_connections: pool size; a caller waits up to `pool_timeout_s` for a free connection
    (then ConnectionError) rather than opening more under a burst.
    socket_timeout_s / connect_timeout_s: per read or write / per connect, seconds.
    retries: attempts after the first on ConnectionError or TimeoutError, each on a fresh
    connection after a jittered backoff; 2 gives three attempts (see `retry_bound_s`).
    health_check_interval_s: a pooled connection idle longer than this is PINGed before use
    (whole seconds; 0 disables), so a connection killed by a restart is replaced before a
    command is lost on it.
    Close it with `await client.aclose()` (the client owns its pool).
    """
    if retries < 0:
        raise ValueError("retries must be >= 0")
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=make_retry(retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=health_check_interval_s,
    )
    return redis.asyncio.Redis.from_pool(pool)
