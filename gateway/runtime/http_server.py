"""uvicorn as the gateway runs it: bounded against slow clients and at shutdown.

uvicorn closes a keep-alive connection idle after a response, but a connection that
never sends a whole request head (or sends one byte at a time) is held forever, and one
that streams an endless header is parsed for as long as it lasts (httptools re-copies a
header value at every read: one such socket stalled every other request for 40 s). The
protocols here give every request head `header_timeout_s` from the moment the connection
is made or its previous response ended, and at most `max_head_bytes` and `max_headers`
lines: beyond either, a 431 in the OpenAI error shape and the connection closed, before
the parser or the app sees more of it. Bodies are bounded by the handlers
(`GatewayConfig.body_timeout_s`). The bounds are one mixin over both of uvicorn's
HTTP/1.1 protocols: httptools (with uvloop, when installed: less CPU per request) and h11
(the fallback). Every accepted connection gets TCP_NODELAY, whatever socket it came from
(asyncio sets it only for sockets created with `IPPROTO_TCP`).

`GatewayServer` bounds SIGTERM: when the grace period is over it calls `on_grace_over`
(the gateway cuts what is still in flight: each request answers its client with a 503
`shutting_down`, in-band on a committed stream, and settles); uvicorn's own
`timeout_graceful_shutdown`, a little later, is the backstop that cancels any handler
still running.
"""

import asyncio
import importlib.util
import json
import logging
import socket
from collections.abc import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 32 * 1024  # a request line and headers (nginx's default large buffers)
MAX_HEADERS = 100
_HEAD_END = b"\r\n\r\n"


def _too_large_response(message: str) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "request_header_fields_too_large",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class HeadTimeout:
    """Mixin over a uvicorn HTTP protocol: close a connection whose request head is not in
    within `header_timeout_s` of the connection or of its previous response, and answer
    431 to a head over `max_head_bytes` or `max_headers` header lines.

    The head is measured on the bytes as they arrive, before the parser is fed: up to the
    first blank line while a head is awaited (a body in the same read is not counted)."""

    header_timeout_s = 10.0
    max_head_bytes = MAX_HEAD_BYTES
    max_headers = MAX_HEADERS
    _head_timer: asyncio.TimerHandle | None = None
    _in_head = True  # the bytes arriving belong to a request head
    _head_bytes = 0
    _head_lines = 0
    _tail = b""  # the head's last 3 bytes, for a blank line split across reads
    _refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            end = (self._tail + data).find(_HEAD_END)
            part = data if end < 0 else data[: max(0, end + 4 - len(self._tail))]
            self._head_bytes += len(part)
            self._head_lines += part.count(b"\n")
            # The request line and the blank line are lines too.
            if self._head_bytes > self.max_head_bytes or self._head_lines > self.max_headers + 2:
                self._refuse_head()
                return
            if end < 0:
                self._tail = (self._tail + data)[-3:]
            else:
                self._in_head = False
                self._head_bytes = self._head_lines = 0
                self._tail = b""
        super().data_received(data)  # type: ignore[misc]

    def _refuse_head(self) -> None:
        self._refused = True
        self._cancel_head_timer()
        transport: asyncio.Transport = self.transport  # type: ignore[attr-defined]
        peer = transport.get_extra_info("peername")
        log.warning(
            "431: a request head from %s over %d bytes or %d headers; connection closed",
            peer,
            self.max_head_bytes,
            self.max_headers,
        )
        if not transport.is_closing():
            transport.write(
                _too_large_response(
                    f"the request head is over {self.max_head_bytes} bytes or "
                    f"{self.max_headers} header fields"
                )
            )
            transport.close()

    def _awaiting_head(self) -> bool:
        """True while every request head received has been answered."""
        raise NotImplementedError

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        loop: asyncio.AbstractEventLoop = self.loop  # type: ignore[attr-defined]
        self._head_timer = loop.call_later(self.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._in_head = True
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def _head_timeout(self) -> None:
        self._head_timer = None
        # A pipelined request may be in already: its response re-arms the timer.
        transport: asyncio.Transport = self.transport  # type: ignore[attr-defined]
        if self._awaiting_head() and not transport.is_closing():
            transport.close()


class _HeadTimeoutH11(HeadTimeout, H11Protocol):
    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def handle_events(self) -> None:
        super().handle_events()
        if not self._awaiting_head():
            self._cancel_head_timer()  # the head is in: the handler bounds the body


def _head_timeout_httptools() -> type | None:
    """The httptools protocol with the head timer; None where httptools is missing."""
    if importlib.util.find_spec("httptools") is None:
        return None
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _HeadTimeoutHttpTools(HeadTimeout, HttpToolsProtocol):
        _heads_in = 0  # request heads parsed on this connection
        _answered = 0  # responses completed on it

        def _awaiting_head(self) -> bool:
            return self._heads_in == self._answered

        def on_headers_complete(self) -> None:
            self._heads_in += 1
            self._cancel_head_timer()  # the head is in: the handler bounds the body
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            self._answered += 1
            super().on_response_complete()

    return _HeadTimeoutHttpTools


def head_timeout_protocol(
    header_timeout_s: float,
    prefer_httptools: bool = True,
    *,
    max_head_bytes: int = MAX_HEAD_BYTES,
    max_headers: int = MAX_HEADERS,
) -> type:
    """An HTTP protocol class closing connections whose request head is late, and
    answering 431 to one too large: httptools' when installed (and preferred), else h11's."""
    base = (_head_timeout_httptools() if prefer_httptools else None) or _HeadTimeoutH11
    bounds = {
        "header_timeout_s": header_timeout_s,
        "max_head_bytes": max_head_bytes,
        "max_headers": max_headers,
    }
    return type(base.__name__.lstrip("_"), (base,), bounds)


def event_loop_name() -> str:
    """uvloop where installed, else asyncio (uvicorn's `loop=` setting)."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


_BACKSTOP_S = 3.0  # after the grace: time for cut requests to answer before uvicorn cancels


class GatewayServer(uvicorn.Server):
    """uvicorn.Server that calls `on_grace_over` once `grace_s` of shutdown have passed."""

    def __init__(
        self, config: uvicorn.Config, grace_s: float, on_grace_over: Callable[[], object]
    ) -> None:
        super().__init__(config)
        self.grace_s = grace_s
        self.on_grace_over = on_grace_over

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace_s, self.on_grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def server_config(
    app: object,
    host: str,
    port: int,
    *,
    header_timeout_s: float,
    keep_alive_timeout_s: float,
    shutdown_grace_s: float,
    log_level: str = "warning",
    prefer_httptools: bool = True,
    max_head_bytes: int = MAX_HEAD_BYTES,
    max_headers: int = MAX_HEADERS,
) -> uvicorn.Config:
    """uvicorn's settings for the gateway. The loop setting applies where uvicorn makes
    the loop (`Server.run`); `switchyard serve` runs `Server.serve` on its own loop."""
    protocol = head_timeout_protocol(
        header_timeout_s, prefer_httptools, max_head_bytes=max_head_bytes, max_headers=max_headers
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        loop=event_loop_name(),
        http=protocol,
        # h11 has its own bound on an unfinished head (16 KiB, a 400): ours answers first.
        h11_max_incomplete_event_size=max_head_bytes + 1024,
        timeout_keep_alive=max(1, round(keep_alive_timeout_s)),
        timeout_graceful_shutdown=max(1, round(shutdown_grace_s + _BACKSTOP_S)),
    )


def reuse_port_socket(host: str, port: int, *, listen: bool) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT, so several gateway processes
    listen on one port and the kernel spreads connections over them. `listen=False`: only
    bound (the supervisor holds the port this way; a bound socket is not given
    connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(2048)
            sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
