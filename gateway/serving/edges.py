"""What the APIs in front of the chat path share (`serving/messages_edge.py`,
`serving/responses_edge.py`): the body checks that come before any decoding, and the
request whose ASGI `send` translates the chat answer into the other API's as it leaves.

`handler.handle(chat=True, edge=...)` runs between: authentication, the edge's
`chat_body`, plan, quota, the fair queue, `model: auto`, retries, usage and settlement,
so every refusal reaches the client through the edge's one translation of the chat
endpoint's error answer, status and headers (Retry-After included) kept."""

from typing import Any, Protocol

from litestar import Request

from gateway.config import GatewayConfig
from workers.api.types import ApiError
from workers.api.validation import check_json_depth


def check_raw(raw: bytes, cfg: GatewayConfig) -> None:
    """Size, then nesting depth, before any parser recurses (as `intake.decode` does)."""
    if len(raw) > cfg.max_body_bytes:
        raise ApiError(
            413, f"request body over {cfg.max_body_bytes} bytes", code="request_too_large"
        )
    check_json_depth(raw, cfg.request_limits.max_json_depth)


class StreamTranslation(Protocol):
    """One stream's translation: the other API's bytes for the chat bytes fed."""

    @property
    def ended(self) -> bool: ...

    def feed(self, data: bytes) -> bytes: ...


class AnswerTranslation(Protocol):
    """How an edge translates the chat answer of one request."""

    def stream(self) -> StreamTranslation: ...

    async def stream_ended(self, stream: Any) -> None:
        """Called once, when the stream has translated its end, before that is sent."""

    async def whole(self, status: int, raw: bytes) -> tuple[int, bytes]:
        """The status and JSON body for a whole (not streamed) chat answer or error."""


def edge_request(request: Request, translation: AnswerTranslation) -> Request:
    """`request` with a send that translates its answer. Its scope is a copy with
    Litestar's cached connection state left out, so the handler reads the body afresh."""
    scope: Any = dict(request.scope)
    scope["state"] = {
        k: v for k, v in request.scope.get("state", {}).items() if not k.startswith("__litestar")
    }
    return Request(scope, request.receive, TranslatingSend(request.send, translation))


class TranslatingSend:
    """An ASGI send through which the chat answer goes out in another API's shape: an
    event stream translated as it is relayed (a token leaves in the write that brought
    it), a JSON answer (success or error) whole."""

    __slots__ = ("_send", "_translation", "_start", "_stream", "_body", "_ended")

    def __init__(self, send: Any, translation: AnswerTranslation) -> None:
        self._send, self._translation = send, translation
        self._start: dict[str, Any] | None = None
        self._stream: StreamTranslation | None = None
        self._body: list[bytes] = []
        self._ended = False

    async def __call__(self, message: Any) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self._start = message
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            if content_type.startswith(b"text/event-stream"):
                self._stream = self._translation.stream()
                await self._send(message)
            return
        if kind != "http.response.body":
            await self._send(message)
            return
        more = message.get("more_body", False)
        if self._stream is not None:
            out = self._stream.feed(message.get("body", b""))
            if self._stream.ended and not self._ended:
                self._ended = True
                await self._translation.stream_ended(self._stream)
            if out or not more:
                await self._send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self._body.append(message.get("body", b""))
        if not more:
            await self._send_whole()

    async def _send_whole(self) -> None:
        assert self._start is not None
        status, content = await self._translation.whole(self._start["status"], b"".join(self._body))
        headers = [(k, v) for k, v in self._start.get("headers", []) if k != b"content-length"]
        headers.append((b"content-length", str(len(content)).encode()))
        await self._send({**self._start, "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": content, "more_body": False})
