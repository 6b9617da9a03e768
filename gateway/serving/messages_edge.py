"""`POST /v1/messages` at the edge of the chat serving path: the Anthropic body is decoded
(strictly) and translated into a chat-completions body once the caller is authenticated,
and the chat answer is translated back as it leaves (`gateway.serving.edges`). Everything
between is `gateway.serving.handler.handle(chat=True)` unchanged: authentication (first,
as for chat), plan, quota, the fair queue, `model: auto`, retries, usage and settlement.

So every refusal, whether this module's (the body) or the serving path's (quota, queue,
model), reaches the client through one translation of the chat endpoint's error answer,
with its status and headers (Retry-After included) kept."""

import json
from typing import Any

import msgspec
from litestar import Request, Response

from gateway.gateway import Gateway
from gateway.serving.edges import check_raw, edge_request
from gateway.serving.handler import handle
from gateway.serving.messages import (
    MessagesRequest,
    error_body,
    from_chat,
    from_chat_error,
    to_chat,
)
from gateway.serving.messages_stream import MessagesStream
from workers.api.types import ApiError, decode_request

MESSAGES_PATH = "/v1/messages"


async def serve_messages(gw: Gateway, request: Request) -> Response:
    """Serve one Messages request through the chat path; its answer is sent here."""
    edge = _MessagesEdge(gw)
    return await handle(gw, edge_request(request, edge), chat=True, edge=edge)


class _MessagesEdge:
    """One Messages request: its body to chat, the chat answer back."""

    __slots__ = ("_gw",)

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw

    async def chat_body(self, raw: bytes, tenant_id: str) -> bytes:
        check_raw(raw, self._gw.config)
        return msgspec.json.encode(to_chat(decode_request(raw, MessagesRequest)))

    def stream(self) -> MessagesStream:
        return MessagesStream()

    async def stream_ended(self, stream: Any) -> None:
        return None

    async def whole(self, status: int, raw: bytes) -> tuple[int, bytes]:
        if status == 200:
            try:
                body = from_chat(json.loads(raw))
            except ApiError as exc:
                status, body = exc.status, error_body("api_error", exc.message)
            except (ValueError, LookupError, TypeError, AttributeError):
                status, body = 502, error_body("api_error", "the model server's answer is not one")
        else:
            body = from_chat_error(status, raw)
        return status, json.dumps(body).encode()


def messages_front(app: Any) -> Any:
    """ASGI middleware, before the door, for Messages requests only (other paths pass
    untouched): Anthropic's `x-api-key` header (with no `Authorization`) is carried as
    `Authorization: Bearer`, so the door and authentication see the one key header they
    read; and a refusal answered before the route runs (the door's 429 `gateway_busy`, a
    body over the size bound) leaves in Anthropic's error shape, as the route's own do."""

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != MESSAGES_PATH:
            await app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        names = {name for name, _ in headers}
        if b"authorization" not in names and b"x-api-key" in names:
            key = next(value for name, value in headers if name == b"x-api-key")
            scope = {**scope, "headers": [*headers, (b"authorization", b"Bearer " + key)]}
        await app(scope, receive, _ErrorShapeSend(send))

    return middleware


class _ErrorShapeSend:
    """A send that rewrites an OpenAI-shaped error answer (`{"error": {...}}`) into
    Anthropic's (`{"type": "error", "error": {...}}`), status and headers kept; an answer
    already in Anthropic's shape, a success or a stream passes as it is."""

    __slots__ = ("_send", "_start", "_body")

    def __init__(self, send: Any) -> None:
        self._send = send
        self._start: dict[str, Any] | None = None
        self._body: list[bytes] = []

    async def __call__(self, message: Any) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            if message["status"] >= 400 and content_type.startswith(b"application/json"):
                self._start = message  # held until the body says which shape it is
                return
        elif kind == "http.response.body" and self._start is not None:
            self._body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await self._flush()
            return
        await self._send(message)

    async def _flush(self) -> None:
        assert self._start is not None
        start, raw = self._start, b"".join(self._body)
        self._start = None
        try:
            decoded = json.loads(raw)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict) and decoded.get("type") != "error" and "error" in decoded:
            raw = json.dumps(from_chat_error(start["status"], raw)).encode()
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            start = {**start, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        await self._send(start)
        await self._send({"type": "http.response.body", "body": raw, "more_body": False})
