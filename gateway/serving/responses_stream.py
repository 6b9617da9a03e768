"""A chat-completions SSE stream as the Responses API's events: pure and incremental, fed
the stream's bytes as they are relayed (`gateway.serving.responses_edge` sends what it
returns at once, so a token reaches the client in the write that brought it).

The sequence: `response.created` and `response.in_progress` (the response with no output
yet); per output item `response.output_item.added`, then for a message
`response.content_part.added`, its `response.output_text.delta`s, `response.output_text.done`
and `response.content_part.done`, or for a function call its
`response.function_call_arguments.delta`s and `.done`; then `response.output_item.done`.
At `[DONE]`: `response.completed` (or `response.incomplete`, for `max_output_tokens`) with
the whole response and the exact usage, from the usage chunk the request asked for. An
in-band error closes what is open and ends with `response.failed`, its `error` set. A
stream cut before `[DONE]` ends with no terminal event, which is how the client knows.

Every event carries its `sequence_number`, counted from 0."""

import json
from typing import Any

from gateway.serving.chat_events import ChatEvents
from gateway.serving.responses import (
    ResponsesRequest,
    call_item,
    error_code,
    message_item,
    new_id,
    response_object,
    status_of,
    usage_of,
)


class ResponsesStream(ChatEvents):
    """The translation of one stream. `feed(bytes)` returns the events those bytes
    complete (an event split across writes waits for its end). `response` is the final
    response object once the stream has ended (completed, incomplete or failed)."""

    __slots__ = (
        "_req",
        "_id",
        "_created_at",
        "_seq",
        "_model",
        "_started",
        "_output",
        "_open",
        "_tool_index",
        "_finish",
        "_usage",
        "response",
    )

    def __init__(self, req: ResponsesRequest, response_id: str, created_at: int) -> None:
        super().__init__()
        self._req, self._id, self._created_at = req, response_id, created_at
        self._seq = 0
        self._model = req.model
        self._started = False
        self._output: list[dict[str, Any]] = []  # items, the last one possibly open
        self._open: dict[str, Any] | None = None  # the open item; None: none open
        self._tool_index: int | None = None  # the chat tool call the open item carries
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self.response: dict[str, Any] | None = None  # set when the stream has ended

    @property
    def ended(self) -> bool:
        return self.response is not None

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The Responses events for one chat chunk."""
        if chunk.get("model"):
            self._model = chunk["model"]
        out = self._start()
        if chunk.get("error") is not None:
            info = chunk["error"] if isinstance(chunk["error"], dict) else {}
            return [*out, *self._fail(info)]
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("content"):
                out.extend(self._text(delta["content"], logprobs))
            for call in delta.get("tool_calls") or []:
                out.extend(self._tool_call(call))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    # -- events

    def _emit(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"

    def _snapshot(self, status: str, **extra: Any) -> dict[str, Any]:
        return response_object(
            self._req,
            self._id,
            self._created_at,
            self._model,
            status=status,
            output=[dict(item) for item in self._output],
            **extra,
        )

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        response = self._snapshot("in_progress")
        return [
            self._emit("response.created", response=response),
            self._emit("response.in_progress", response=response),
        ]

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._output.append(item)
        self._open = item
        out.append(
            self._emit("response.output_item.added", output_index=len(self._output) - 1, item=item)
        )
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        item = self._open
        if item is None:
            return []
        self._open, self._tool_index = None, None
        index = len(self._output) - 1
        item["status"] = status
        out: list[bytes] = []
        if item["type"] == "message":
            part = item["content"][0]
            place = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(
                self._emit(
                    "response.output_text.done",
                    **place,
                    text=part["text"],
                    logprobs=part["logprobs"],
                )
            )
            out.append(self._emit("response.content_part.done", **place, part=part))
        else:
            out.append(
                self._emit(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    name=item["name"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        out.append(self._emit("response.output_item.done", output_index=index, item=item))
        return out

    def _text(self, text: str, logprobs: list[Any]) -> list[bytes]:
        out: list[bytes] = []
        item = self._open
        if item is None or item["type"] != "message":
            item = message_item(new_id("msg"), "", [], "in_progress")
            part = item["content"].pop()  # announced on its own, after the item
            out = self._add(item)
            out.append(
                self._emit(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(self._output) - 1,
                    content_index=0,
                    part=part,
                )
            )
            item["content"].append(part)
        part = item["content"][0]
        part["text"] += text
        part["logprobs"].extend(logprobs)
        out.append(
            self._emit(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=len(self._output) - 1,
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )
        return out

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        function = call.get("function") or {}
        index = call.get("index", 0)
        out: list[bytes] = []
        item = self._open
        if item is None or item["type"] != "function_call" or self._tool_index != index:
            name = function.get("name", "")
            out = self._add(call_item(new_id("fc"), call.get("id", ""), name, "", "in_progress"))
            self._tool_index = index
            item = self._open
            assert item is not None
        arguments = function.get("arguments")
        if arguments:
            item["arguments"] += arguments
            out.append(
                self._emit(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=len(self._output) - 1,
                    delta=arguments,
                )
            )
        return out

    def done(self) -> list[bytes]:
        status, incomplete = status_of(self._finish)
        out = self._start()
        out.extend(self._close("completed" if status == "completed" else "incomplete"))
        self.response = self._snapshot(status, usage=usage_of(self._usage), incomplete=incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._emit(kind, response=self.response))
        return out

    def _fail(self, info: dict[str, Any]) -> list[bytes]:
        out = self._close("incomplete")
        error = {
            "code": error_code(info.get("type"), info.get("code")),
            "message": str(info.get("message") or "the model server failed"),
        }
        self.response = self._snapshot("failed", usage=usage_of(self._usage), error=error)
        out.append(self._emit("response.failed", response=self.response))
        return out
