"""`workers.api.http1` treats the server as untrusted input: a bounded head, a bounded body
read whole, and no byte that was not asked for reaching anyone (an interim 1xx, a second
response behind the first, bytes waiting on an idle connection). Raw servers on loopback."""

import asyncio
import socket
import threading
import time

import pytest

from tests.unit.workers.test_http1 import JSON, raw_server, read_request
from workers.api.http1 import BodyTooLarge, Http1Error, Http1Pool

pytestmark = pytest.mark.asyncio


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def test_a_head_past_the_bound_fails_before_the_rest_arrives() -> None:
    """The server means to send a 64 MiB header; the exchange fails once 64 KiB of head
    are in, and the connection is closed under the server's writes."""
    hung_up = asyncio.Event()

    async def handle(reader, writer) -> None:  # noqa: ANN001
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Junk: ")
        try:
            for _ in range(64):
                writer.write(b"a" * (1 << 20))
                await writer.drain()
        except ConnectionError:
            hung_up.set()
        writer.close()

    async with raw_server(handle) as (pool, origin):
        t0 = time.monotonic()
        with pytest.raises(Http1Error, match="head over 65536 bytes"):
            await pool.post(origin, "/x", b"{}", JSON)
        assert time.monotonic() - t0 < 1.0
        await asyncio.wait_for(hung_up.wait(), 10)


async def test_a_head_just_within_the_bound_is_read() -> None:
    async def handle(reader, writer) -> None:  # noqa: ANN001
        await read_request(reader)
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Pad: "
        pad = b"p" * (1000 - len(head) - 4)
        writer.write(head + pad + b"\r\n\r\nok")
        await writer.drain()

    async with raw_server(handle) as (_, origin):
        pool = Http1Pool(max_head_bytes=1000)
        try:
            r = await pool.post(origin, "/x", b"{}", JSON)
            assert await r.aread() == b"ok"
            r.close()
        finally:
            await pool.aclose()


async def test_a_body_read_whole_past_max_bytes_fails_and_drops_the_connection() -> None:
    """An endless chunked body: `aread(max_bytes)` stops at the bound instead of holding
    everything the server sends."""
    hung_up = asyncio.Event()

    async def handle(reader, writer) -> None:  # noqa: ANN001
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"10000\r\n" + b"x" * 65536 + b"\r\n"
        try:
            while True:
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            hung_up.set()
        writer.close()

    async with raw_server(handle) as (pool, origin):
        r = await pool.post(origin, "/x", b"{}", JSON)
        with pytest.raises(BodyTooLarge):
            await r.aread(1 << 20)
        r.close()
        await asyncio.wait_for(hung_up.wait(), 10)
        assert pool._idle.get(origin) in (None, [])  # noqa: SLF001


async def test_an_interim_100_nobody_asked_for_fails_the_exchange() -> None:
    """No `Expect: 100-continue` is sent, so a 100 is a protocol violation: not an answer
    with status 100, and not the answer after it either."""

    async def handle(reader, writer) -> None:  # noqa: ANN001
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"late"))
        await writer.drain()

    async with raw_server(handle) as (pool, origin):
        with pytest.raises(Http1Error, match="interim 100"):
            await pool.post(origin, "/x", b"{}", JSON)


async def test_a_second_response_in_the_same_write_reaches_no_one() -> None:
    """The server answers and, in the same write, sends a second response. The first is
    whole and alone; the connection is dropped, so the next request gets its own answer
    on a new one."""

    async def handle(reader, writer) -> None:  # noqa: ANN001
        while True:
            try:
                body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            extra = ok(b"LEAK") if body == b"first" else b""
            writer.write(ok(b"answer to " + body) + extra)
            await writer.drain()

    async with raw_server(handle) as (pool, origin):
        r1 = await pool.post(origin, "/x", b"first", JSON)
        assert await r1.aread() == b"answer to first"
        r1.close()
        r2 = await pool.post(origin, "/x", b"second", JSON)
        assert await r2.aread() == b"answer to second"
        r2.close()
        assert pool.connects == 2


class ThreadServer:
    """A blocking server on a thread: answers the first request of each connection; on the
    first connection, once `send_extra` is set, it writes an unasked response and sets
    `extra_sent`. Every later request is answered with its own body."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.origin = self.sock.getsockname()[:2]
        self.send_extra = threading.Event()
        self.extra_sent = threading.Event()
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            first = self.connections == 1
            threading.Thread(target=self._serve, args=(conn, first), daemon=True).start()

    def _serve(self, conn: socket.socket, first: bool) -> None:
        try:
            self._answer(conn, first)
        except OSError:  # the client dropped the connection
            pass

    def _answer(self, conn: socket.socket, first: bool) -> None:
        with conn, conn.makefile("rb") as f:
            while True:
                length = 0
                while (line := f.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if not line:
                    return
                body = f.read(length)
                conn.sendall(ok(b"answer to " + body))
                if first:
                    first = False
                    self.send_extra.wait(10)
                    conn.sendall(ok(b"LEAK"))
                    self.extra_sent.set()


async def test_bytes_waiting_on_an_idle_connection_are_not_taken_as_the_next_answer() -> None:
    """An unasked response lands on an idle kept-alive connection just before the next
    request takes it, before the event loop has looked at the socket (the test blocks the
    loop while the server writes). The connection is not reused: the request is answered
    on a new one, with its own answer."""
    server = ThreadServer()
    pool = Http1Pool()
    try:
        r1 = await pool.post(server.origin, "/x", b"one", JSON)
        assert await r1.aread() == b"answer to one"
        r1.close()
        server.send_extra.set()
        assert server.extra_sent.wait(10)  # blocking: the loop cannot read the socket
        r2 = await pool.post(server.origin, "/x", b"two", JSON)
        assert await r2.aread() == b"answer to two"
        r2.close()
        assert pool.connects == 2
    finally:
        await pool.aclose()
        server.sock.close()
