"""`POST /v1/responses` at the edge of the chat serving path, and the stored responses'
`GET` and `DELETE /v1/responses/{id}`.

The Responses body is decoded (strictly) once the caller is authenticated, a
`previous_response_id` is read from the tenant's store, and the chat body that serves it
goes through `handler.handle(chat=True)` unchanged (`gateway.serving.edges`). The chat
answer is translated back as it leaves; with `store` (the default) the response and its
conversation are written before the client reads the response's end, so a continuation
sent the moment it has the id finds it."""

import json
import logging
import time
from typing import Any

import msgspec
from litestar import Request, Response

from gateway.gateway import Gateway
from gateway.serving.edges import check_raw, edge_request
from gateway.serving.handler import handle
from gateway.serving.responses import (
    ResponsesRequest,
    chat_messages,
    check,
    from_chat,
    items_of,
    new_id,
    output_messages,
    stored,
    to_chat,
)
from gateway.serving.responses_store import ResponseStore
from gateway.serving.responses_stream import ResponsesStream
from workers.api.types import ApiError, decode_request

log = logging.getLogger(__name__)


async def serve_responses(gw: Gateway, request: Request) -> Response:
    """Serve one Responses request through the chat path; its answer is sent here."""
    edge = _ResponsesEdge(gw)
    return await handle(gw, edge_request(request, edge), chat=True, edge=edge)


async def get_response(gw: Gateway, tenant_id: str, response_id: str) -> dict[str, Any]:
    record = await _store(gw).load(tenant_id, response_id)
    if record is None:
        raise _not_found(response_id)
    response: dict[str, Any] = record["response"]
    return response


async def delete_response(gw: Gateway, tenant_id: str, response_id: str) -> dict[str, Any]:
    if not await _store(gw).delete(tenant_id, response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _store(gw: Gateway) -> ResponseStore:
    return ResponseStore(gw.redis, gw.config.responses_retention_s)


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404, f"no stored response `{response_id}`", param="response_id", code="not_found"
    )


class _ResponsesEdge:
    """One Responses request: its body to chat (`chat_body`, called by the handler once
    the caller is known) and the chat answer back (`stream`, `stream_ended`, `whole`)."""

    __slots__ = ("_gw", "_tenant", "_req", "_conversation", "_id", "_created_at")

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw
        self._tenant: str | None = None
        self._req: ResponsesRequest | None = None
        self._conversation: list[dict[str, Any]] = []  # history and this input, as chat
        self._id = new_id("resp")
        self._created_at = int(time.time())

    async def chat_body(self, raw: bytes, tenant_id: str) -> bytes:
        check_raw(raw, self._gw.config)
        req = decode_request(raw, ResponsesRequest)
        check(req, self._gw.config.max_tokens_cap)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = await _store(self._gw).history(tenant_id, req.previous_response_id)
        chat = to_chat(req, history)
        self._tenant, self._req = tenant_id, req
        self._conversation = [*history, *chat_messages(items_of(req))]
        return msgspec.json.encode(chat)

    def stream(self) -> ResponsesStream:
        assert self._req is not None  # a stream is only answered to a decoded request
        return ResponsesStream(self._req, self._id, self._created_at)

    async def stream_ended(self, stream: Any) -> None:
        if stream.response is not None:
            await self._save(stream.response)

    async def whole(self, status: int, raw: bytes) -> tuple[int, bytes]:
        if status != 200 or self._req is None:
            return status, raw  # the chat endpoint's error: already OpenAI's shape
        try:
            response = from_chat(json.loads(raw), self._req, self._id, self._created_at)
        except (ValueError, LookupError, TypeError, AttributeError):
            err = ApiError(
                502,
                "the model server's answer is not one",
                type="server_error",
                code="upstream_failed",
            )
            return err.status, json.dumps(err.body()).encode()
        await self._save(response)
        return status, json.dumps(response).encode()

    async def _save(self, response: dict[str, Any]) -> None:
        """Keep the response for GET and continuation when the request asked (`store`).
        A store that fails loses only that: the answer is still sent, and logged."""
        req, tenant = self._req, self._tenant
        if req is None or tenant is None or not req.store:
            return
        conversation = [*self._conversation, *output_messages(response["output"])]
        try:
            await _store(self._gw).save(tenant, self._id, stored(response, conversation))
        except Exception:
            log.warning("response %s was not stored", self._id, exc_info=True)
