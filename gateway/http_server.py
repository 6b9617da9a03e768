"""uvicorn as the gateway runs it: bounded against slow clients and at shutdown.

uvicorn closes a keep-alive connection idle after a response, but a connection that
never sends a whole request head (or sends one byte at a time) is held forever. The
protocol here gives every request head `header_timeout_s` from the moment the connection
is made or its previous response ended; bodies are bounded by the handlers
(`GatewayConfig.body_timeout_s`). `GatewayServer` bounds SIGTERM: when the grace period is over it
calls `on_grace_over` (the gateway cuts what is still in flight: each request answers
its client with a 503 `shutting_down`, in-band on a committed stream, and settles);
uvicorn's own `timeout_graceful_shutdown`, a little later, is the backstop that cancels
any handler still running.
"""

import asyncio
import socket
from collections.abc import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeadTimeoutH11(H11Protocol):
    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE and self._head_timer is not None:
            self._head_timer.cancel()  # the head is in: the handler bounds the body
            self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def head_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """An h11 protocol class closing connections whose request head is late."""
    return type("HeadTimeoutH11", (_HeadTimeoutH11,), {"header_timeout_s": header_timeout_s})


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
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=head_timeout_protocol(header_timeout_s),
        timeout_keep_alive=max(1, round(keep_alive_timeout_s)),
        timeout_graceful_shutdown=max(1, round(shutdown_grace_s + _BACKSTOP_S)),
    )
