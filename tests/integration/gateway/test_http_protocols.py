"""The gateway's HTTP protocols, httptools (with uvloop) and the h11 fallback, served as a
gateway member serves them (a SO_REUSEPORT socket): a late request head closes the
connection, the timer starts again after each response, accepted connections get
TCP_NODELAY, a head too large or with too many fields is a 431."""

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.runtime.http_server import (
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    reuse_port_socket,
    server_config,
)
from tests.support.waiting import closed_after, eventually

HEADER_S = 1.0


async def _ok(scope, receive, send) -> None:  # noqa: ANN001 (ASGI)
    if scope["type"] != "http":
        return
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def _served(prefer_httptools: bool) -> Iterator[tuple[uvicorn.Server, int]]:
    config = server_config(
        _ok,
        "127.0.0.1",
        0,
        header_timeout_s=HEADER_S,
        keep_alive_timeout_s=30,
        shutdown_grace_s=1,
        prefer_httptools=prefer_httptools,
    )
    config.lifespan = "off"
    if not prefer_httptools:
        config.loop = "asyncio"  # the fallback as a whole: neither uvloop nor httptools
    sock = reuse_port_socket("127.0.0.1", 0, listen=True)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert eventually(lambda: server.started)
        yield server, sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(5)


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    raw = b""
    while not raw.endswith(b"ok"):
        chunk = sock.recv(4096)
        assert chunk, raw
        raw += chunk
    return raw


@pytest.mark.timeout(30)
@pytest.mark.parametrize("httptools", [True, False], ids=["httptools", "h11"])
def test_a_late_head_is_closed_after_each_response_and_connections_get_nodelay(httptools):
    with _served(httptools) as (server, port):
        base = HttpToolsProtocol if httptools else H11Protocol
        assert issubclass(server.config.http_protocol_class, base)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            assert _get(sock).startswith(b"HTTP/1.1 200")
            (conn,) = server.server_state.connections
            served = conn.transport.get_extra_info("socket")
            assert served.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert _get(sock).startswith(b"HTTP/1.1 200")  # kept alive
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
            took = closed_after(sock, time.monotonic(), HEADER_S + 5)
        assert HEADER_S * 0.9 < took < HEADER_S + 1.5, took


def test_uvloop_and_httptools_are_chosen_where_installed():
    config = server_config(
        _ok, "127.0.0.1", 1, header_timeout_s=1, keep_alive_timeout_s=1, shutdown_grace_s=1
    )
    assert config.loop == "uvloop"
    assert issubclass(config.http, HttpToolsProtocol)


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    raw = b""
    try:
        while chunk := sock.recv(65536):
            raw += chunk
    except ConnectionResetError:
        pass
    return raw


def _assert_431(raw: bytes) -> None:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), raw[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "request_header_fields_too_large"
    assert error["type"] == "invalid_request_error" and "message" in error


@pytest.mark.timeout(60)
@pytest.mark.parametrize("httptools", [True, False], ids=["httptools", "h11"])
def test_an_endless_header_is_refused_with_431_while_others_are_served(httptools):
    with _served(httptools) as (_, port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as attacker:
            attacker.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nx-big: ")
            sent, refused = 0, False
            while sent < 4 * MAX_HEAD_BYTES:  # far past the cap, if nothing cut it
                try:
                    attacker.sendall(b"a" * 4096)
                except (BrokenPipeError, ConnectionResetError):
                    refused = True
                    break
                sent += 4096
                with socket.create_connection(("127.0.0.1", port), timeout=10) as other:
                    assert _get(other).startswith(b"HTTP/1.1 200")  # served meanwhile
                if sent > MAX_HEAD_BYTES + 65536:
                    break
            attacker.settimeout(10)
            raw = _answer(attacker)
        assert refused or raw, "the endless head was neither refused nor closed"
        if raw:
            _assert_431(raw)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("httptools", [True, False], ids=["httptools", "h11"])
def test_too_many_headers_are_431_and_a_body_full_of_lines_is_not_a_head(httptools):
    with _served(httptools) as (_, port):
        many = "".join(f"x-h{i}: v\r\n" for i in range(MAX_HEADERS + 1))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: x\r\n{many}\r\n".encode())
            _assert_431(_answer(sock))
        # A head just under both bounds, then a body of thousands of lines in the same write.
        fields = "".join(f"x-h{i}: v\r\n" for i in range(MAX_HEADERS - 3))  # + host, x-big, length
        fields += "x-big: " + "a" * (MAX_HEAD_BYTES - len(fields) - 200) + "\r\n"
        body = b"[\n" + b"1,\n" * 5000 + b"1]"
        head = f"POST / HTTP/1.1\r\nHost: x\r\n{fields}content-length: {len(body)}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head.encode() + body)
            raw = b""
            while not raw.endswith(b"ok"):
                chunk = sock.recv(4096)
                assert chunk, raw
                raw += chunk
            assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
