"""The OpenAI Responses API (`POST /v1/responses`) as a chat-completions request and back:
pure functions over plain data, no I/O. `gateway.serving.responses_edge` runs them around
the chat serving path, so quotas, the fair queue, `model: auto`, usage and retries are the
chat endpoint's own, for every pool kind.

Decoding is strict, as for chat: a field not declared here is a 400 naming it, never
dropped; a declared field whose value this server cannot honour (`reasoning` with an
effort, `truncation: auto`, `background: true`, an `include` other than logprobs, a tool
other than a function, an image or file input) is a 400 naming it too.

A conversation continued with `previous_response_id` is the stored response's chat
messages (its inputs and its outputs, without its `instructions`, which OpenAI does not
carry over) followed by the new input."""

import json
import time
import uuid
from typing import Any, Literal

import msgspec

from workers.api.types import ApiError

# ---------------------------------------------------------------------------------------
# The request


class InputText(msgspec.Struct, tag="input_text", tag_field="type", forbid_unknown_fields=True):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", forbid_unknown_fields=True):
    """An assistant's earlier text, replayed as input (as the SDKs replay output items)."""

    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | None = None


class Refusal(msgspec.Struct, tag="refusal", tag_field="type", forbid_unknown_fields=True):
    refusal: str


ContentPart = InputText | OutputText | Refusal


class MessageItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A message item (`type: message`, or the "easy" form without a type)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None  # an output item's id and status, when one is replayed
    status: str | None = None
    phase: None = None


class FunctionCallItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


class FunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema: its name, schema, description and strictness
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only verbosity a model here has


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_obfuscation: bool = False


LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A `/v1/responses` body, as far as this gateway implements it."""

    model: str
    input: str | list[dict[str, Any]]  # items are typed by `items_of` (by their `type`)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool = False


def check(req: ResponsesRequest, max_tokens_cap: int | None = None) -> None:
    """The declared fields whose values this server cannot honour, or that contradict each
    other: 400 naming each (in this API's names: the chat path would name its own)."""
    if req.background:
        raise ApiError(400, "background responses are not supported", param="background")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise ApiError(
            400, "reasoning options are not supported by this server's models", param="reasoning"
        )
    for name in req.include or []:
        if name != LOGPROBS_INCLUDE:
            raise ApiError(400, f"include `{name}` is not supported", param="include")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise ApiError(
            400, "stream obfuscation is not supported", param="stream_options.include_obfuscation"
        )
    if req.metadata is not None and len(req.metadata) > 16:
        raise ApiError(400, "metadata holds at most 16 pairs", param="metadata")
    if req.max_output_tokens is not None and not (
        1 <= req.max_output_tokens <= (max_tokens_cap or req.max_output_tokens)
    ):
        bound = f"between 1 and {max_tokens_cap}" if max_tokens_cap else "at least 1"
        raise ApiError(400, f"max_output_tokens must be {bound}", param="max_output_tokens")
    if not req.tools and req.tool_choice not in (None, "none", "auto"):
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if not req.stream and req.stream_options is not None:
        raise ApiError(400, "stream_options needs `stream: true`", param="stream_options")


def items_of(req: ResponsesRequest) -> list[InputItem]:
    """The request's input as typed items; a 400 naming the item and field that is wrong."""
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    items: list[InputItem] = []
    for i, raw in enumerate(req.input):
        kind = raw.get("type", "message")
        cls = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise ApiError(
                400,
                f"input item type `{kind}` is not supported (message, function_call and "
                f"function_call_output are) - at `$.input[{i}].type`",
                param="input",
            )
        try:
            items.append(msgspec.convert(raw, cls))
        except msgspec.ValidationError as exc:
            message = str(exc).replace("`$", f"`$.input[{i}]")
            if "`$" not in str(exc):
                message += f" - at `$.input[{i}]`"
            raise ApiError(400, message, param="input") from None
    return items


# ---------------------------------------------------------------------------------------
# Request to chat


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """The chat messages for input items: a function call joins the assistant message
    before it (parallel calls are one assistant message), its output is a `tool` message."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = item.output if isinstance(item.output, str) else _text(item.output)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return out


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in content)


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body that serves `req` after the stored conversation
    `history` (chat messages). A stream asks for usage, so the response's usage is the one
    the tenant is charged."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages.extend(history)
    messages.extend(chat_messages(items_of(req)))
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    k: v
                    for k, v in (
                        ("name", t.name),
                        ("description", t.description),
                        ("parameters", t.parameters),
                        ("strict", t.strict),
                    )
                    if v is not None
                },
            }
            for t in req.tools
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    response_format = _response_format(req.text)
    if response_format is not None:
        body["response_format"] = response_format
    user = req.safety_identifier or req.user
    if user is not None:
        body["user"] = user
    if LOGPROBS_INCLUDE in (req.include or []) or req.top_logprobs:
        body["logprobs"] = True
        if req.top_logprobs:
            body["top_logprobs"] = req.top_logprobs
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _response_format(text: TextParam | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if not fmt.name:
        raise ApiError(400, "a json_schema format needs its `name`", param="text.format.name")
    schema: dict[str, Any] = {"name": fmt.name}
    for key, value in (
        ("schema", fmt.schema),
        ("description", fmt.description),
        ("strict", fmt.strict),
    ):
        if value is not None:
            schema[key] = value
    return {"type": "json_schema", "json_schema": schema}


# ---------------------------------------------------------------------------------------
# Chat to the response


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any]:
    """The Responses usage for a chat usage. `input_tokens` include the cached ones, as
    OpenAI counts them; nothing is charged for writing the cache, so its count is 0."""
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """A response's status and `incomplete_details` for its chat `finish_reason`."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def message_item(item_id: str, text: str, logprobs: list[Any], status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete: dict[str, str] | None = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The response object, every field OpenAI's schema requires, echoing the request."""
    fmt = req.text.format if req.text is not None else None
    text_format: dict[str, Any] = {"type": "text"}
    if fmt is not None and fmt.type != "text":
        text_format = {k: v for k, v in msgspec.to_builtins(fmt).items() if v is not None}
    tools = [{**msgspec.to_builtins(t), "strict": bool(t.strict)} for t in req.tools or []]
    choice = req.tool_choice
    response = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": text_format},
        "tool_choice": (
            choice
            if isinstance(choice, str)
            else msgspec.to_builtins(choice)
            if choice is not None
            else "auto"
        ),
        "tools": tools,
        "top_logprobs": req.top_logprobs or 0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": "disabled",
        "metadata": dict(req.metadata or {}),
    }
    # Objects or strings when present, in OpenAI's schema: absent until known or unset.
    if usage is not None:
        response["usage"] = usage
    if req.user is not None:
        response["user"] = req.user
    return response


def from_chat(
    answer: dict[str, Any], req: ResponsesRequest, response_id: str, created_at: int
) -> dict[str, Any]:
    """The response for a chat completion (its first choice; `n` is never sent)."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    status, incomplete = status_of(choice.get("finish_reason"))
    item_status = "completed" if status == "completed" else "incomplete"
    output: list[dict[str, Any]] = []
    if message.get("content"):
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        output.append(message_item(new_id("msg"), message["content"], logprobs, item_status))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        output.append(
            call_item(
                new_id("fc"), call["id"], function["name"], function["arguments"], "completed"
            )
        )
    return response_object(
        req,
        response_id,
        created_at,
        answer.get("model", req.model),
        status=status,
        output=output,
        usage=usage_of(answer.get("usage")),
        incomplete=incomplete,
    )


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a continuation replays."""
    items: list[InputItem] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            items.append(MessageItem(role="assistant", content=text))
        elif item["type"] == "function_call":
            items.append(
                FunctionCallItem(
                    type="function_call",
                    call_id=item["call_id"],
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
    return chat_messages(items)


def error_code(openai_type: str | None, code: Any) -> str:
    """The Responses error code (its schema's enum) for a chat error's type and code."""
    if openai_type in ("rate_limit_error", "insufficient_quota") or code == "rate_limit_exceeded":
        return "rate_limit_exceeded"
    return "server_error"


def stored(response: dict[str, Any], conversation: list[dict[str, Any]]) -> bytes:
    """What the store keeps for a response: the object and its conversation so far."""
    return json.dumps({"response": response, "conversation": conversation}).encode()
