"""One Redis connection shared by every request of a gateway process, its commands pipelined.

The quota scripts run twice per request (reserve on the path, reconcile after it). Through
redis-py's pooled client one call cost 131-151 us of CPU sequentially and 57-90 us with 16
in flight (connection checkout under a Condition, the retry wrapper, packing, a read per
reply); here 36-50 us and 6-8 us (an EVALSHA against the same embedded Redis, measured side
by side in one process). Redis runs commands one at a time, in the order a connection sends
them, so one connection carries every caller: a command is packed (hiredis), appended to
a buffer that is written once per event-loop pass (the reconciles of one pass go out in
one `write`), and its future waits in a FIFO that the replies, parsed by hiredis as they
arrive, resolve in order.

Failure semantics match `quota.connection.make_redis`, which the limiter's failure policy
was written against: a command whose reply is not in within `socket_timeout_s` raises
redis `TimeoutError` and drops the connection (the replies behind it are out of step
once one is abandoned); a lost connection fails every command in flight with redis
`ConnectionError`; either is sent again on a fresh connection after a jittered backoff, up
to `retries` more times, which is safe because every quota script is idempotent (see
`quota.connection`). An error reply raises `ResponseError` to its caller only.
"""

import asyncio
import collections
import ssl
from typing import Any

import hiredis
from redis.asyncio.connection import parse_url
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from quota.connection import RETRY_BASE_S, RETRY_CAP_S

__all__ = ["PipelinedRedis"]

_DOWN = (RedisConnectionError, RedisTimeoutError)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class _Connection(asyncio.Protocol):
    """A socket to Redis: writes coalesced per loop pass, replies matched to futures in
    order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.waiting: collections.deque[tuple[asyncio.Future, asyncio.TimerHandle]] = (
            collections.deque()
        )
        self.outgoing: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self._break(RedisConnectionError(f"Redis protocol error: {exc}"))
                return
            if reply is False:
                return
            if not self.waiting:  # a reply nobody asked for: the stream is out of step
                self._break(RedisConnectionError("unexpected reply from Redis"))
                return
            future, timer = self.waiting.popleft()
            timer.cancel()
            if future.done():  # its caller was cancelled; the reply is discarded in order
                continue
            if isinstance(reply, ResponseError):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = RedisConnectionError(f"connection to Redis lost: {exc or 'closed by peer'}")
        self.transport = None
        self._fail_waiting(self.lost)

    # -- used by PipelinedRedis

    @property
    def usable(self) -> bool:
        return self.lost is None and self.transport is not None

    def send(self, packed: bytes) -> asyncio.Future:
        future = self.loop.create_future()
        timer = self.loop.call_later(self.timeout_s, self._timed_out, future)
        self.waiting.append((future, timer))
        if not self.outgoing:
            self.loop.call_soon(self._flush)
        self.outgoing.append(packed)
        return future

    def close(self) -> None:
        self._break(RedisConnectionError("connection to Redis closed"))

    def _flush(self) -> None:
        if self.transport is not None and self.outgoing:
            self.transport.write(b"".join(self.outgoing))
        self.outgoing.clear()

    def _timed_out(self, future: asyncio.Future) -> None:
        if not future.done():
            future.set_exception(
                RedisTimeoutError(f"no reply from Redis within {self.timeout_s:g} s")
            )
        # Later replies would be matched to the wrong callers: start over on a new socket.
        self._break(RedisConnectionError("connection to Redis dropped after a timeout"))

    def _break(self, exc: Exception) -> None:
        if self.lost is None:
            self.lost = exc
        if self.transport is not None:
            self.transport.abort()
            self.transport = None
        self._fail_waiting(self.lost)

    def _fail_waiting(self, exc: Exception) -> None:
        while self.waiting:
            future, timer = self.waiting.popleft()
            timer.cancel()
            if not future.done():
                future.set_exception(exc)
        self.outgoing.clear()


class PipelinedRedis:
    """Commands from any number of tasks over one connection to `url` (`redis://`,
    `rediss://` or `unix://`, with user, password and db as redis-py reads them).

    socket_timeout_s: the most a command waits for its reply; connect_timeout_s: per
    connect (with AUTH and SELECT); retries: attempts after the first on a lost connection
    or a timeout, with the same jittered backoff as `quota.connection.make_redis`.
    """

    def __init__(
        self,
        url: str,
        *,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        retries: int = 2,
    ) -> None:
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.url = url
        self.socket_timeout_s = socket_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self._params = parse_url(url)
        self._backoff = ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S)
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future | None = None
        self._closed = False
        self.connects = 0  # connections made (the first and every reconnect)

    async def execute(self, *args: Any) -> Any:
        """Run one command (`execute("GET", "k")`), retrying on a lost connection or a
        timeout; its reply as hiredis gives it (bytes, int, list, None)."""
        conn = self._conn
        if conn is not None and conn.usable and conn.loop is asyncio.get_running_loop():
            # The hot path: no retry machinery.
            try:
                return await conn.send(hiredis.pack_command(args))
            except _DOWN:
                if self.retries == 0:
                    raise
                failures = 1
        else:
            failures = 0
        while True:
            try:
                conn = await self._connection()
                return await conn.send(hiredis.pack_command(args))
            except _DOWN:
                failures += 1
                if failures > self.retries or self._closed:
                    raise
                await asyncio.sleep(self._backoff.compute(failures))

    async def run_script(self, script: str, sha: str, keys: list, args: list) -> Any:
        """EVALSHA `sha`; where the server does not have the script (restarted, flushed),
        EVAL sends its text, which also caches it for the next EVALSHA."""
        try:
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)
        except ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.execute("EVAL", script, len(keys), *keys, *args)

    async def aclose(self) -> None:
        self._closed = True
        if self._conn is not None and self._conn.loop is asyncio.get_running_loop():
            self._conn.close()
        self._conn = None

    async def _connection(self) -> _Connection:
        if self._closed:
            raise RedisConnectionError("the pipelined Redis client is closed")
        loop = asyncio.get_running_loop()
        if self._conn is not None and self._conn.loop is not loop:
            # Made on an event loop that is gone or not this one (a caller that runs
            # several loops in turn): left to that loop, a new one is made here.
            self._conn, self._connecting = None, None
        if self._conn is not None and self._conn.usable:
            return self._conn
        if self._connecting is None or self._connecting.done():
            # One connect at a time; the callers meanwhile wait for it. A caller cancelled
            # while waiting does not cancel it (shield) and its outcome is always retrieved.
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(_retrieve)
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        p = self._params

        def protocol() -> _Connection:
            return _Connection(loop, self.socket_timeout_s)

        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if "path" in p:
                    _, conn = await loop.create_unix_connection(protocol, p["path"])
                else:
                    tls = self._tls_context() if p.get("connection_class") else None
                    _, conn = await loop.create_connection(
                        protocol, p.get("host", "localhost"), p.get("port", 6379), ssl=tls
                    )
                handshake = []
                if p.get("password"):
                    user = [p["username"]] if p.get("username") else []
                    auth: tuple[Any, ...] = ("AUTH", *user, p["password"])
                    handshake.append(conn.send(hiredis.pack_command(auth)))
                if p.get("db"):
                    select: tuple[Any, ...] = ("SELECT", p["db"])
                    handshake.append(conn.send(hiredis.pack_command(select)))
                try:
                    await asyncio.gather(*handshake)
                except ResponseError as exc:
                    conn.close()
                    raise RedisConnectionError(f"Redis refused the connection: {exc}") from exc
        except TimeoutError as exc:
            raise RedisTimeoutError(
                f"connecting to Redis took over {self.connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:
            where = self._where()
            raise RedisConnectionError(f"cannot connect to Redis at {where}: {exc}") from exc
        if self._closed:
            conn.close()
            raise RedisConnectionError("the pipelined Redis client is closed")
        self._conn = conn
        self.connects += 1
        return conn

    def _where(self) -> str:
        """The server's address, without credentials."""
        p = self._params
        return p["path"] if "path" in p else f"{p.get('host', 'localhost')}:{p.get('port', 6379)}"

    def _tls_context(self) -> ssl.SSLContext:
        p = self._params
        cafile = p.get("ssl_ca_certs")
        context = ssl.create_default_context(cafile=str(cafile) if cafile else None)
        if str(p.get("ssl_cert_reqs", "required")).lower() in ("none", "cert_none"):
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context
