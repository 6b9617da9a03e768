"""`workers.api.http1`, the gateway's upstream HTTP/1.1 client, against real servers on loopback:
an aiohttp server for well-formed answers and raw asyncio servers for the ways a worker can
misbehave (dying mid-body, closing a kept-alive socket as a request arrives)."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
from aiohttp import web

from workers.api.http1 import ConnectFailed, Http1Error, Http1Pool

pytestmark = pytest.mark.asyncio

JSON = b"Content-Type: application/json\r\n"


class App:
    """An aiohttp server: /echo answers the body back (and notes the peer), /stream sends
    `n` chunks, waiting for `go` before the last."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.peers: set = set()

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.add(request.transport.get_extra_info("peername"))
        return web.Response(body=await request.read(), headers={"X-Echo": "yes"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        n = int(request.query.get("n", "5"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(n):
            if i == n - 1:
                await self.go.wait()
            await response.write(f"data: {i}\n\n".encode())
        await response.write_eof()
        return response


@pytest_asyncio.fixture
async def app_origin() -> AsyncIterator[tuple[App, tuple[str, int]]]:
    app = App()
    web_app = web.Application()
    web_app.router.add_post("/echo", app.echo)
    web_app.router.add_post("/stream", app.stream)
    runner = web.AppRunner(web_app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
    try:
        yield app, ("127.0.0.1", port)
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def raw_server(handle: Callable) -> AsyncIterator[tuple[Http1Pool, tuple[str, int]]]:
    """A raw asyncio server running `handle` per connection, and a pool to talk to it."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    pool = Http1Pool()
    try:
        yield pool, server.sockets[0].getsockname()[:2]
    finally:
        await pool.aclose()
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


async def test_sequential_requests_reuse_one_connection(app_origin) -> None:
    app, origin = app_origin
    pool = Http1Pool()
    try:
        for i in range(3):
            r = await pool.post(origin, "/echo", f"body {i}".encode(), JSON)
            assert (r.status_code, r.headers["x-echo"]) == (200, "yes")
            assert await r.aread() == f"body {i}".encode()
            r.close()
        assert pool.connects == 1 and len(app.peers) == 1
    finally:
        await pool.aclose()


async def test_a_chunked_stream_arrives_piece_by_piece(app_origin) -> None:
    app, origin = app_origin
    pool = Http1Pool()
    try:
        r = await pool.post(origin, "/stream?n=4", b"{}", JSON)
        assert r.status_code == 200
        got = b""
        async for piece in r.aiter_raw():
            got += piece
            if got == b"data: 0\n\ndata: 1\n\ndata: 2\n\n":
                app.go.set()  # the last chunk only after the first three were read
        assert got == b"".join(f"data: {i}\n\n".encode() for i in range(4))
        r.close()
        again = await pool.post(origin, "/echo", b"x", JSON)
        assert await again.aread() == b"x"
        again.close()
        assert pool.connects == 1  # read to its end: the connection was kept
    finally:
        await pool.aclose()


async def test_closing_an_unfinished_stream_closes_the_connection() -> None:
    """The worker learns the request was abandoned: its socket reaches end of file."""
    disconnected = asyncio.Event()

    async def handle(reader, writer) -> None:  # noqa: ANN001
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 0\n\n\r\n")
        await writer.drain()
        if await reader.read() == b"":
            disconnected.set()
        writer.close()

    async with raw_server(handle) as (pool, origin):
        r = await pool.post(origin, "/stream", b"{}", JSON)
        assert await anext(r.aiter_raw()) == b"data: 0\n\n"
        r.close()
        await asyncio.wait_for(disconnected.wait(), 10)
        assert pool._idle.get(origin) in (None, [])  # noqa: SLF001 (not kept for reuse)


async def test_a_server_dying_mid_body_hands_out_what_arrived_then_fails() -> None:
    async def handle(reader, writer) -> None:  # noqa: ANN001
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await writer.drain()
        writer.close()

    async with raw_server(handle) as (pool, origin):
        r = await pool.post(origin, "/x", b"{}", JSON)
        got = []
        with pytest.raises(Http1Error):
            async for piece in r.aiter_raw():
                got.append(piece)
        assert b"".join(got) == b"0123456789"
        r.close()
        r2 = await pool.post(origin, "/x", b"{}", JSON)
        with pytest.raises(Http1Error):
            await r2.aread()
        r2.close()


async def test_a_body_framed_by_the_close_is_read_whole() -> None:
    async def handle(reader, writer) -> None:  # noqa: ANN001
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    async with raw_server(handle) as (pool, origin):
        r = await pool.post(origin, "/x", b"{}", JSON)
        assert await r.aread() == b"all of it"
        r.close()


async def test_a_kept_alive_socket_closed_as_a_request_arrives_is_retried_once() -> None:
    """The server answers one request per connection, then reads the next and hangs up
    without a word (what a server closing an idle keep-alive socket looks like to a client
    that wrote just then): the request goes again, on a new connection."""
    bodies = []

    async def handle(reader, writer) -> None:  # noqa: ANN001
        bodies.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        try:
            await read_request(reader)
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    async with raw_server(handle) as (pool, origin):
        for i in range(2):
            r = await pool.post(origin, "/x", f"{i}".encode(), JSON)
            assert await r.aread() == b"ok"
            r.close()
        assert pool.connects == 2
        assert bodies == [b"0", b"1"]  # the second request was answered once, on socket 2


async def test_an_idle_connection_older_than_the_timeout_is_not_reused(app_origin) -> None:
    _, origin = app_origin
    pool = Http1Pool(idle_timeout_s=0.0)
    try:
        for _ in range(2):
            r = await pool.post(origin, "/echo", b"x", JSON)
            await r.aread()
            r.close()
        assert pool.connects == 2
    finally:
        await pool.aclose()


async def test_nothing_listening_is_a_connect_failure(unused_tcp_port: int) -> None:
    pool = Http1Pool(connect_timeout_s=1.0)
    with pytest.raises(ConnectFailed):
        await pool.post(("127.0.0.1", unused_tcp_port), "/x", b"{}", JSON)
