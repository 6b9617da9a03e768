"""A chat-completions SSE stream as Anthropic's Messages events: pure and incremental, fed
the stream's bytes as they are relayed (`gateway.serving.messages_edge` sends what it
returns at once, so a token reaches the client in the write that brought it).

The sequence: `message_start` (empty content; usage so far, which the chat stream does not
tell before its end, so zeros), then per content block `content_block_start`, its deltas
(`text_delta`, or `input_json_delta` with a tool call's argument text as generated) and
`content_block_stop`; at `[DONE]`, `message_delta` (stop_reason and the exact usage, from
the usage chunk the request asked for) and `message_stop`. An in-band error becomes an
`error` event and ends the stream. A stream cut before `[DONE]` ends with no
`message_stop`, which is how the client knows it was cut."""

import json
from typing import Any

from gateway.serving.chat_events import ChatEvents
from gateway.serving.messages import (
    error_body,
    error_type,
    stop_reason_of,
    stop_sequence_of,
    usage_of,
)


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One event as Anthropic sends it: an `event:` line, then its `data:` line."""
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"


class MessagesStream(ChatEvents):
    """The translation of one stream. `feed(bytes)` returns the Anthropic events those
    bytes complete (an event split across writes waits for its end)."""

    __slots__ = (
        "_started",
        "_block",
        "_index",
        "_tool_index",
        "_finish",
        "_matched",
        "_usage",
        "_ended",
    )

    def __init__(self) -> None:
        super().__init__()
        self._started = False
        self._block: str | None = None  # the open block's type; None: none open
        self._index = -1  # the open (or last) block's index
        self._tool_index: int | None = None  # the chat tool call the open block carries
        self._finish: str | None = None
        self._matched: Any = None  # the stop string that ended it, when the chunk names one
        self._usage: dict[str, Any] | None = None
        self._ended = False  # [DONE] or an error was translated: nothing more is sent

    @property
    def ended(self) -> bool:
        return self._ended

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The Anthropic events for one chat chunk."""
        if chunk.get("error") is not None:
            self._ended = True
            info = chunk["error"] if isinstance(chunk["error"], dict) else {}
            kind = error_type(0, info.get("type"), info.get("code"))
            return [sse_event("error", error_body(kind, str(info.get("message", "error"))))]
        out = self._start(chunk)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out.extend(self._text(delta["content"]))
            for call in delta.get("tool_calls") or []:
                out.extend(self._tool_call(call))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                self._matched = choice.get("stop_reason")
        return out

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message = {
            "id": chunk.get("id", ""),
            "type": "message",
            "role": "assistant",
            "model": chunk.get("model", ""),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_of(chunk.get("usage")),
        }
        return [sse_event("message_start", {"type": "message_start", "message": message})]

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._index += 1
        self._block = block["type"]
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return [*out, sse_event("content_block_start", start)]

    def _close(self) -> list[bytes]:
        if self._block is None:
            return []
        self._block, self._tool_index = None, None
        stop = {"type": "content_block_stop", "index": self._index}
        return [sse_event("content_block_stop", stop)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        event = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return sse_event("content_block_delta", event)

    def _text(self, text: str) -> list[bytes]:
        out = [] if self._block == "text" else self._open({"type": "text", "text": ""})
        return [*out, self._delta({"type": "text_delta", "text": text})]

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        function = call.get("function") or {}
        index = call.get("index", 0)
        out: list[bytes] = []
        if self._block != "tool_use" or self._tool_index != index:
            block = {
                "type": "tool_use",
                "id": call.get("id", ""),
                "name": function.get("name", ""),
                "input": {},
            }
            out = self._open(block)
            self._tool_index = index
        if function.get("arguments"):
            out.append(
                self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
            )
        return out

    def done(self) -> list[bytes]:
        out = self._start({})
        out.extend(self._close())
        self._ended = True
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": stop_reason_of(self._finish, self._matched),
                "stop_sequence": stop_sequence_of(self._finish, self._matched),
            },
            "usage": usage_of(self._usage),
        }
        out.append(sse_event("message_delta", delta))
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        return out
