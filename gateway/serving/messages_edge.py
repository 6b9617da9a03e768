"""`POST /v1/messages` at the edge of the chat serving path: the Anthropic body is decoded
(strictly) and translated into a chat-completions body where the handler reads its body,
and the chat answer is translated back where the handler sends it. Everything between is
`gateway.serving.handler.handle(chat=True)` unchanged: authentication (first, as for chat),
plan, quota, the fair queue, `model: auto`, retries, usage and settlement.

So every refusal, whether this module's (the body) or the serving path's (quota, queue,
model), reaches the client through one translation of the chat endpoint's error answer,
with its status and headers (Retry-After included) kept."""

import json
from typing import Any

import msgspec
from litestar import Request, Response

from gateway.gateway import Gateway
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
from workers.api.validation import check_json_depth

MESSAGES_PATH = "/v1/messages"


async def serve_messages(gw: Gateway, request: Request) -> Response:
    """Serve one Messages request through the chat path; its answer is sent here."""
    receive = _TranslatingReceive(gw, request.receive)
    send = _TranslatingSend(request.send)
    # A copy of the scope with Litestar's cached connection state left out: the handler's
    # request reads its body from `receive`, never the one Litestar may have cached.
    scope: Any = dict(request.scope)
    scope["state"] = {
        k: v for k, v in request.scope.get("state", {}).items() if not k.startswith("__litestar")
    }
    return await handle(gw, Request(scope, receive, send), chat=True)


class _TranslatingReceive:
    """The request's ASGI receive, whose first message is the translated chat body; later
    calls (the disconnect listener's) go to the client's own."""

    __slots__ = ("_gw", "_receive", "_read")

    def __init__(self, gw: Gateway, receive: Any) -> None:
        self._gw, self._receive, self._read = gw, receive, False

    async def __call__(self) -> Any:
        if self._read:
            return await self._receive()
        self._read = True
        raw = await self._raw_body()
        check_json_depth(raw, self._gw.config.request_limits.max_json_depth)
        chat = to_chat(decode_request(raw, MessagesRequest))
        return {"type": "http.request", "body": msgspec.json.encode(chat), "more_body": False}

    async def _raw_body(self) -> bytes:
        limit = self._gw.config.max_body_bytes
        chunks, size = [], 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ApiError(400, "the client left before its body arrived")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TranslatingSend:
    """The request's ASGI send, through which the chat answer goes out as Anthropic's: an
    event stream translated as it is relayed, a JSON answer (message or error) whole."""

    __slots__ = ("_send", "_start", "_stream", "_body")

    def __init__(self, send: Any) -> None:
        self._send = send
        self._start: dict[str, Any] | None = None
        self._stream: MessagesStream | None = None
        self._body: list[bytes] = []

    async def __call__(self, message: Any) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self._start = message
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            if content_type.startswith(b"text/event-stream"):
                self._stream = MessagesStream()
                await self._send(message)
            return
        if kind != "http.response.body":
            await self._send(message)
            return
        more = message.get("more_body", False)
        if self._stream is not None:
            out = self._stream.feed(message.get("body", b""))
            if out or not more:
                await self._send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self._body.append(message.get("body", b""))
        if not more:
            await self._send_json()

    async def _send_json(self) -> None:
        assert self._start is not None
        status = self._start["status"]
        raw = b"".join(self._body)
        if status == 200:
            try:
                body = from_chat(json.loads(raw))
            except ApiError as exc:
                status, body = exc.status, error_body("api_error", exc.message)
            except (ValueError, LookupError, TypeError, AttributeError):
                status, body = 502, error_body("api_error", "the model server's answer is not one")
        else:
            body = from_chat_error(status, raw)
        content = json.dumps(body).encode()
        headers = [(k, v) for k, v in self._start.get("headers", []) if k != b"content-length"]
        headers.append((b"content-length", str(len(content)).encode()))
        await self._send({**self._start, "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": content, "more_body": False})


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
