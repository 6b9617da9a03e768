"""The Anthropic Messages API (`POST /v1/messages`) as a chat-completions request and back:
pure functions over plain data, no I/O. `gateway.serving.messages_edge` runs them around the
chat serving path, so quotas, the fair queue, `model: auto`, usage and retries are the
chat endpoint's own.

Decoding is strict, as for chat: a field not declared here is a 400 naming it, never
dropped (`cache_control`, `thinking`, images and documents are refused, not ignored)."""

import json
from typing import Any, Literal

import msgspec

from workers.api.types import ApiError


class TextBlock(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    text: str
    citations: None = None  # an answer's block sent back as it came (the SDKs dump nulls)


class DirectCaller(msgspec.Struct, tag="direct", tag_field="type", forbid_unknown_fields=True):
    """Who called a tool: the model itself (the only caller this gateway's answers name)."""


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type", forbid_unknown_fields=True):
    id: str
    name: str
    input: dict[str, Any]
    caller: DirectCaller | None = None
    toolset_name: None = None


class ToolResultBlock(
    msgspec.Struct, tag="tool_result", tag_field="type", forbid_unknown_fields=True
):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # `tool`: the tool it must call
    disable_parallel_tool_use: bool = False


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: str | None = None


class MessagesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A `/v1/messages` body, as far as this gateway implements it."""

    model: str
    max_tokens: int
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # the worker extra; refused by pools whose kind cannot take it
    stream: bool = False
    metadata: Metadata | None = None


def to_chat(req: MessagesRequest) -> dict[str, Any]:
    """The chat-completions body that serves `req`. A stream asks for usage, so the
    message's usage is the one the tenant is charged."""
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text(req.system)})
    for message in req.messages:
        messages.extend(_chat_messages(message))
    body: dict[str, Any] = {"model": req.model, "max_tokens": req.max_tokens, "messages": messages}
    if req.tools is not None:
        body["tools"] = [
            {
                "type": "function",
                "function": _omit_none(
                    name=t.name, description=t.description, parameters=t.input_schema
                ),
            }
            for t in req.tools
        ]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
        if req.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    body.update(_omit_none(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k))
    if req.metadata is not None and req.metadata.user_id is not None:
        body["user"] = req.metadata.user_id
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become `tool` messages (before
    the user's text, which follows them in the turn), tool uses an assistant's tool calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    uses = [b for b in message.content if isinstance(b, ToolUseBlock)]
    results = [b for b in message.content if isinstance(b, ToolResultBlock)]
    if message.role == "user" and uses:
        raise ApiError(400, "a `tool_use` block belongs to an assistant message", param="messages")
    if message.role == "assistant" and results:
        raise ApiError(400, "a `tool_result` block belongs to a user message", param="messages")
    out: list[dict[str, Any]] = [
        {
            "role": "tool",
            "tool_call_id": r.tool_use_id,
            "content": ("Error: " if r.is_error else "") + _text(r.content),
        }
        for r in results
    ]
    if message.role == "assistant":
        reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if uses:
            reply["tool_calls"] = [
                {
                    "id": u.id,
                    "type": "function",
                    "function": {"name": u.name, "arguments": json.dumps(u.input)},
                }
                for u in uses
            ]
        out.append(reply)
    elif texts or not results:
        parts = [{"type": "text", "text": t} for t in texts]
        out.append({"role": "user", "content": texts[0] if len(texts) == 1 else parts})
    return out


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def _tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(
                400, "tool_choice of type `tool` needs the tool's `name`", param="tool_choice"
            )
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _omit_none(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason_of(finish_reason: str | None, matched: Any = None) -> str:
    """Anthropic's `stop_reason` for a chat `finish_reason` (`content_filter`: `refusal`);
    `matched`: the choice's `stop_reason` (the stop string that ended it, which the worker
    and vLLM name), which makes a `stop` a `stop_sequence`."""
    if finish_reason == "content_filter":
        return "refusal"
    if finish_reason in (None, "stop") and isinstance(matched, str):
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")


def stop_sequence_of(finish_reason: str | None, matched: Any) -> str | None:
    """The stop sequence that ended a message, or None."""
    return matched if stop_reason_of(finish_reason, matched) == "stop_sequence" else None


def usage_of(usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage for a chat usage: `input_tokens` are the prompt tokens not read
    from the cache, so input + cache_read + output is what the tenant was charged."""
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": prompt - cached,
        "output_tokens": int(usage.get("completion_tokens") or 0),
        "cache_read_input_tokens": cached,
    }


def from_chat(answer: dict[str, Any]) -> dict[str, Any]:
    """The Anthropic message for a chat completion (its first choice; a Messages request is
    never sent with `n`). A tool call whose arguments are not a JSON object is a 502: the
    message cannot carry it."""
    choice = answer["choices"][0]
    chat_message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if chat_message.get("content"):
        content.append({"type": "text", "text": chat_message["content"]})
    for call in chat_message.get("tool_calls") or []:
        function = call["function"]
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ApiError(
                502,
                f"the model's arguments for tool `{function['name']}` are not a JSON object",
                type="server_error",
                code="upstream_failed",
            )
        content.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments}
        )
    return {
        "id": answer.get("id", ""),
        "type": "message",
        "role": "assistant",
        "model": answer.get("model", ""),
        "content": content,
        "stop_reason": stop_reason_of(choice.get("finish_reason"), choice.get("stop_reason")),
        "stop_sequence": stop_sequence_of(choice.get("finish_reason"), choice.get("stop_reason")),
        "usage": usage_of(answer.get("usage")),
    }


def error_type(status: int, openai_type: str | None = None, code: Any = None) -> str:
    """Anthropic's error type for a chat error's HTTP status (or, in a stream, where there
    is no status, for its OpenAI type and code)."""
    if status == 0:
        if openai_type in ("rate_limit_error", "insufficient_quota"):
            return "rate_limit_error"
        if openai_type in ("invalid_request_error", "permission_error"):
            return openai_type
        return "overloaded_error" if code in OVERLOAD_CODES else "api_error"
    by_status = {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        429: "rate_limit_error",
        503: "overloaded_error",
    }
    if status in by_status:
        return by_status[status]
    return "invalid_request_error" if status < 500 else "api_error"


# In-band error codes that mean "busy, retry": the 503s of the chat endpoint.
OVERLOAD_CODES = frozenset(
    {
        "server_overloaded",
        "over_capacity",
        "upstream_rate_limited",
        "upstream_unavailable",
        "deadline_exceeded",
        503,
    }
)


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def from_chat_error(status: int, body: bytes) -> dict[str, Any]:
    """Anthropic's error body for a chat endpoint's error answer (OpenAI-shaped, or not)."""
    try:
        info = json.loads(body).get("error") or {}
        message = str(info.get("message") or f"the gateway answered {status}")
    except (ValueError, AttributeError):
        message = f"the gateway answered {status}"
    return error_body(error_type(status), message)
