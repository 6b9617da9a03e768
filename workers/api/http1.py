"""The gateway's hot-path HTTP/1.1 client: POST a body to a worker over a kept-alive
connection and read the answer whole or as it arrives.

Every public request makes one such call, so its cost is on every request. With 16 in
flight to the fake backend, aiohttp spent 0.15 ms of CPU per plain POST and this client, an
asyncio protocol around httptools' parser, 0.06 ms (`switchyard bench upstream`,
docs/benchmarks/upstream-clients.md). It does only what the gateway needs of a worker: one request
at a time per connection, bodies framed by Content-Length or chunked (or by the close),
idle connections kept per origin and dropped before the server's own keep-alive timeout.

What the caller sees (`workers.api.client.UpstreamResponse` wraps it):
- `ConnectFailed` when no connection could be made, `Http1Error` when the connection fails
  before the response head (nothing was answered) or while the body is read (what had
  arrived is handed out first);
- a body not read to its end closes the connection when the response is closed (which is
  how a worker learns its request was abandoned); one read to its end goes back to the
  idle connections if both sides keep it alive.

The server is untrusted input, our own workers included: a response head is at most
`max_head_bytes` (the parser's cost grows with the square of one long header's pieces), a
body read whole at most what the caller allows (`aread(max_bytes)`), and a byte nobody
asked for drops the connection without reaching anyone: an interim 1xx (we never send
`Expect`), a second response after the one asked for, or anything that arrives on an idle
connection, seen as it arrives or, at the latest, when the connection is taken for reuse.
"""

import asyncio
import collections
import select
import time
from collections.abc import AsyncIterator

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "BodyTooLarge",
    "ConnectFailed",
    "Http1Error",
    "Http1Pool",
    "Http1Response",
    "NothingAnswered",
]

_HIGH_WATER = 1 << 20  # buffered, unread body bytes above which reading pauses
_LOW_WATER = 1 << 18


class Http1Error(Exception):
    """The connection failed (or the server spoke something other than HTTP/1.x)."""


class ConnectFailed(Http1Error):
    """No connection could be made (refused, unreachable, or not within the timeout)."""


class NothingAnswered(Http1Error):
    """The connection ended before any byte of a response."""


class BodyTooLarge(Http1Error):
    """A body read whole was longer than the caller allows (the connection is dropped)."""


class _Unasked(Exception):
    """Raised inside a parser callback: the server sent something that was not asked for."""


class _Connection(asyncio.Protocol):
    """One socket to an origin; a response parser fed from it."""

    def __init__(self, pool: "Http1Pool", origin: tuple[str, int]) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Http1Response | None = None  # the exchange in progress
        self.head_left = 0  # bytes the response head may still take; -1 once it is in
        self.began = False  # a response message began for the exchange in progress
        self.lost = False
        self.paused = False
        self.idle_since = 0.0

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.pool.heard[self.origin] = time.monotonic()
        response = self.response
        if response is None or response.complete:
            # Bytes nobody asked for (after the answer, or on an idle connection): they
            # reach no one, and the connection is not one to keep.
            self._drop()
            return
        if self.head_left >= 0:  # the head is still arriving: bounded
            if len(data) > self.head_left:
                head, data = data[: self.head_left], data[self.head_left :]
                self.head_left = 0
                if not self._feed(head, response):
                    return
                if self.head_left >= 0:
                    limit = self.pool.max_head_bytes
                    self._refuse(response, Http1Error(f"a response head over {limit} bytes"))
                    return
            else:
                self.head_left -= len(data)
        self._feed(data, response)

    def _feed(self, data: bytes, response: "Http1Response") -> bool:
        """Parse `data`; False when it ended the exchange (the connection dropped)."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(response, Http1Error("the server switched protocols"))
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            reason = str(cause) if isinstance(cause, _Unasked) else f"malformed: {cause!r}"
            self._refuse(response, Http1Error(reason))
        except httptools.HttpParserError as exc:
            self._refuse(response, Http1Error(f"malformed HTTP response: {exc}"))
        else:
            return not self.lost
        return False

    def _refuse(self, response: "Http1Response", exc: Http1Error) -> None:
        """The server broke the protocol: the exchange fails (an answer already whole
        keeps what it got) and the connection is dropped."""
        response._fail(exc)
        self._drop()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.transport = None
        self.pool._forget(self)
        response = self.response
        if response is not None and not response.complete:
            if response.status_code and response._ends_at_close:
                response._end()  # a body framed by the close
            elif not response.status_code and not response._raw_headers:
                reason = f"{exc!r}" if exc else "the server closed the connection"
                response._fail(NothingAnswered(reason))
            else:
                reason = f"{exc!r}" if exc else "the server closed the connection"
                response._fail(Http1Error(reason))

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if self.began:
            raise _Unasked("a second response to one request")
        self.began = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.response._raw_headers.append((name, value))  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if status < 200:
            raise _Unasked(f"an interim {status} response (no Expect was sent)")
        self.head_left = -1
        response.status_code = status
        response._keep_alive = self.parser.should_keep_alive()
        response._head_done()

    def on_body(self, body: bytes) -> None:
        self.response._piece(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        self.response._end()  # type: ignore[union-attr]

    # -- flow control of the body

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _drop(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.lost = True
        self.pool._forget(self)


class Http1Response:
    """A response whose head has arrived; its body read with `aread` or `aiter_raw`, then
    `close` it."""

    __slots__ = (
        "status_code",
        "_conn",
        "_raw_headers",
        "_headers",
        "_keep_alive",
        "_head",
        "_pieces",
        "_buffered",
        "_wakeup",
        "complete",
        "_error",
        "closed",
    )

    def __init__(self, conn: _Connection) -> None:
        self.status_code = 0
        self._conn = conn
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: CIMultiDictProxy[str] | None = None
        self._keep_alive = False
        self._head: asyncio.Future[None] = conn.loop.create_future()
        self._pieces: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._wakeup: asyncio.Future[None] | None = None
        self.complete = False  # the body ended (all of it arrived)
        self._error: Exception | None = None
        self.closed = False

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """Case-insensitive."""
        if self._headers is None:
            raw = self._raw_headers
            pairs = ((k.decode("latin-1"), v.decode("latin-1")) for k, v in raw)
            self._headers = CIMultiDictProxy(CIMultiDict(pairs))
        return self._headers

    async def aread(self, max_bytes: int | None = None) -> bytes:
        """The whole body. Raises Http1Error if the connection fails first, BodyTooLarge
        (dropping the connection) once more than `max_bytes` arrived (None: no bound)."""
        pieces = []
        received = 0
        async for piece in self.aiter_raw():
            received += len(piece)
            if max_bytes is not None and received > max_bytes:
                self._conn._drop()
                raise BodyTooLarge(f"a body over {max_bytes} bytes")
            pieces.append(piece)
        return b"".join(pieces)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (the transfer encoding removed). What arrived
        before a failure is handed out before Http1Error is raised."""
        while True:
            if self._pieces:
                piece = b"".join(self._pieces)
                self._pieces.clear()
                self._buffered = 0
                self._conn.resume()
                yield piece
                continue
            if self.complete:
                return
            if self._error is not None:
                raise self._error
            self._wakeup = self._conn.loop.create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None

    def close(self) -> None:
        """Back to the idle connections if the body was read to its end and both sides
        keep the connection; else the connection is closed."""
        if self.closed:
            return
        self.closed = True
        conn = self._conn
        conn.response = None
        if self.complete and self._keep_alive and not self._pieces and not conn.lost:
            conn.pool._release(conn)
        else:
            conn._drop()

    # -- fed by the connection

    @property
    def _ends_at_close(self) -> bool:
        """A body framed by the connection's end: no length, not chunked."""
        h = self.headers
        return "content-length" not in h and "chunked" not in h.get("transfer-encoding", "")

    def _head_done(self) -> None:
        if not self._head.done():
            self._head.set_result(None)

    def _piece(self, body: bytes) -> None:
        self._pieces.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _end(self) -> None:
        self.complete = True
        self._head_done()
        self._wake()

    def _fail(self, exc: Exception) -> None:
        if self._error is None and not self.complete:
            self._error = exc
            if not self._head.done():
                self._head.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)


class Http1Pool:
    """Kept-alive connections per origin (host, port).

    connect_timeout_s: per connect. idle_timeout_s: an idle connection older than this is
    closed instead of reused; keep it under the servers' keep-alive timeout (uvicorn's
    default is 5 s), so a request is not sent on a socket the server is closing.
    max_idle_per_origin: idle connections kept per origin (more are closed).
    max_head_bytes: the most a response's status line and headers may take (else the
    exchange fails with Http1Error and the connection is dropped).
    """

    def __init__(
        self,
        connect_timeout_s: float = 2.0,
        *,
        idle_timeout_s: float = 4.0,
        max_idle_per_origin: int = 256,
        max_head_bytes: int = 65536,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self.max_head_bytes = max_head_bytes
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self.connects = 0  # connections made
        # time.monotonic() when a byte last came from an origin (proof that it is alive)
        self.heard: dict[tuple[str, int], float] = {}
        self._poll = select.poll()

    async def post(
        self, origin: tuple[str, int], path: str, body: bytes, headers: bytes = b""
    ) -> Http1Response:
        """Send `body` to `path` with `headers` (already encoded lines, each ending in
        CRLF); the response once its head has arrived."""
        host, port = origin
        request = (
            (
                f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {len(body)}\r\n"
            ).encode("latin-1")
            + headers
            + b"\r\n"
            + body
        )
        conn = self._idle_connection(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, request)
            except NothingAnswered:
                # A kept-alive socket the server closed as we wrote to it: the request
                # was not read there. Once more, on a new connection.
                pass
        return await self._exchange(await self._connect(origin), request)

    async def _exchange(self, conn: _Connection, request: bytes) -> Http1Response:
        response = Http1Response(conn)
        conn.response = response
        conn.head_left = self.max_head_bytes
        conn.began = False
        assert conn.transport is not None
        conn.transport.write(request)
        try:
            await response._head
        except BaseException:
            response.close()  # cancelled, or failed: the connection is not reusable
            raise
        return response

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        for conn in list(self._all):
            if conn.loop is loop:
                conn._drop()
        self._all.clear()  # those of a loop that is gone went with it
        self._idle.clear()

    def _idle_connection(self, origin: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        stale_before = time.monotonic() - self.idle_timeout_s
        loop = asyncio.get_running_loop()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be stale
            if conn.loop is not loop:  # made on a loop that is gone: left to it
                self._all.discard(conn)
                continue
            if conn.lost or conn.idle_since < stale_before or self._readable(conn):
                conn._drop()
                continue
            return conn
        return None

    def _readable(self, conn: _Connection) -> bool:
        """Bytes (or the end) wait on an idle connection that the event loop has not
        handed over yet: nothing was asked there, so it is not reused (a request sent on
        it would be answered with them)."""
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is None:
            return False
        fd = sock.fileno()
        if fd < 0:
            return True
        self._poll.register(fd, select.POLLIN)
        try:
            return bool(self._poll.poll(0))
        finally:
            self._poll.unregister(fd)

    async def _connect(self, origin: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port = origin
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin), host, port
                )
        except TimeoutError:
            raise ConnectFailed(f"no connection within {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise ConnectFailed(repr(exc)) from exc
        self._all.add(conn)
        self.connects += 1
        return conn

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= self.max_idle_per_origin:
            conn._drop()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)
