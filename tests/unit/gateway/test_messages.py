"""The Messages API translation, both ways, as pure functions: the request (tool blocks
included), the answer, errors, and the event sequence a chat stream becomes."""

import json

import msgspec
import pytest

from gateway.serving.messages import (
    MessagesRequest,
    error_type,
    from_chat,
    from_chat_error,
    to_chat,
)
from gateway.serving.messages_stream import MessagesStream
from workers.api.types import ApiError, decode_request


def request(**fields) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return decode_request(json.dumps({**body, **fields}).encode(), MessagesRequest)


def test_plain_fields_map_to_their_chat_names():
    chat = to_chat(
        request(
            system="sys",
            stop_sequences=["END"],
            temperature=0.2,
            top_p=0.9,
            top_k=4,
            metadata={"user_id": "u"},
        )
    )
    assert chat == {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
        "stop": ["END"],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 4,
        "user": "u",
    }


def test_a_stream_asks_for_usage():
    chat = to_chat(request(stream=True))
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_tool_blocks_become_tool_calls_and_tool_messages():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                {"type": "tool_use", "id": "t2", "name": "g", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "one"}],
                },
                {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
                {"type": "text", "text": "go on"},
            ],
        },
    ]
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    chat = to_chat(request(messages=messages, tools=tools, tool_choice={"type": "any"}))
    assert chat["messages"][0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    assistant = chat["messages"][1]
    assert assistant["content"] == "calling"
    assert [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in assistant["tool_calls"]
    ] == [
        ("t1", "f", {"x": 1}),
        ("t2", "g", {}),
    ]
    assert chat["messages"][2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "one"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: boom"},
        {"role": "user", "content": "go on"},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == "required"


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_tool_choice_maps_to_its_chat_form(choice, expected):
    assert to_chat(request(tool_choice=choice))["tool_choice"] == expected


def test_a_named_tool_choice_without_a_name_and_misplaced_blocks_are_400s():
    with pytest.raises(ApiError, match="name"):
        to_chat(request(tool_choice={"type": "tool"}))
    use = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    with pytest.raises(ApiError, match="assistant"):
        to_chat(request(messages=[{"role": "user", "content": [use]}]))


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"thinking": {}}, "thinking"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ],
)
def test_unknown_or_unsupported_input_is_a_400_naming_the_field(extra, named):
    with pytest.raises(ApiError) as refused:
        request(**extra)
    assert refused.value.status == 400 and refused.value.param == named


def test_max_tokens_is_required():
    with pytest.raises(ApiError) as refused:
        decode_request(b'{"model": "m", "messages": []}', MessagesRequest)
    assert refused.value.param == "max_tokens"


def chat_answer(message: dict, finish: str, cached: int = 0) -> dict:
    usage = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {
        "id": "c1",
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
    }


def test_an_answer_with_text_and_tool_calls_becomes_content_blocks():
    call = {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}}
    message = {"role": "assistant", "content": "sure", "tool_calls": [call]}
    answer = from_chat(chat_answer(message, "tool_calls", cached=3))
    assert answer == {
        "id": "c1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "text", "text": "sure"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 2}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 7, "output_tokens": 4, "cache_read_input_tokens": 3},
    }


@pytest.mark.parametrize(
    ("finish", "reason"), [("stop", "end_turn"), ("length", "max_tokens"), (None, "end_turn")]
)
def test_finish_reasons_map_to_stop_reasons(finish, reason):
    answer = from_chat(chat_answer({"role": "assistant", "content": "x"}, finish))
    assert answer["stop_reason"] == reason


def test_a_matched_stop_string_is_a_stop_sequence_and_a_stop_token_is_not():
    """The choice's `stop_reason` names the stop string that ended it (the worker's and
    vLLM's field); a stop token id is not one of the request's stop sequences."""
    answer = chat_answer({"role": "assistant", "content": "x"}, "stop")
    answer["choices"][0]["stop_reason"] = "\n\n"
    got = from_chat(answer)
    assert (got["stop_reason"], got["stop_sequence"]) == ("stop_sequence", "\n\n")
    answer["choices"][0]["stop_reason"] = 7
    got = from_chat(answer)
    assert (got["stop_reason"], got["stop_sequence"]) == ("end_turn", None)
    last = chunk({"content": "a"}, finish="stop")
    last["choices"][0]["stop_reason"] = "END"
    stream = MessagesStream()
    got_events = events(stream.feed(sse(last, b"[DONE]")))
    assert got_events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_tool_arguments_that_are_not_an_object_are_a_502():
    call = {"id": "t", "type": "function", "function": {"name": "f", "arguments": "[1"}}
    with pytest.raises(ApiError) as failed:
        from_chat(chat_answer({"role": "assistant", "tool_calls": [call]}, "tool_calls"))
    assert failed.value.status == 502


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (413, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (429, "rate_limit_error"),
        (503, "overloaded_error"),
        (500, "api_error"),
        (502, "api_error"),
    ],
)
def test_error_statuses_map_to_anthropic_error_types(status, kind):
    body = msgspec.json.encode(
        {"error": {"message": "why", "type": "x", "param": None, "code": None}}
    )
    assert from_chat_error(status, body) == {
        "type": "error",
        "error": {"type": kind, "message": "why"},
    }


def test_in_band_errors_map_by_their_type_and_code():
    assert error_type(0, "server_error", "server_overloaded") == "overloaded_error"
    assert error_type(0, "server_error", "upstream_failed") == "api_error"
    assert error_type(0, "rate_limit_error", None) == "rate_limit_error"


def sse(*chunks: object) -> bytes:
    return b"".join(
        b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n"
        for c in chunks
    )


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for event in raw.decode().strip().split("\n\n"):
        name, data = event.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "c1", "model": "m", "choices": choices, **({"usage": usage} if usage else {})}


def test_a_stream_of_text_then_a_tool_call_becomes_the_event_sequence():
    usage = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
    call_start = {
        "index": 0,
        "id": "t1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"x"'},
    }
    call_rest = {"index": 0, "function": {"arguments": ": 1}"}}
    raw = sse(
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "He"}),
        chunk({"content": "llo"}),
        chunk({"tool_calls": [call_start]}),
        chunk({"tool_calls": [call_rest]}, finish="tool_calls"),
        chunk(usage=usage),
        b"[DONE]",
    )
    stream = MessagesStream()
    # Fed in arbitrary pieces, an event split across writes included.
    out = b"".join(stream.feed(raw[i : i + 37]) for i in range(0, len(raw), 37))
    got = events(out)
    assert [name for name, _ in got] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert got[0][1]["message"]["content"] == [] and got[0][1]["message"]["id"] == "c1"
    assert got[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert [e["delta"]["text"] for n, e in got[2:4]] == ["He", "llo"]
    assert got[5][1]["content_block"] == {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    assert "".join(e["delta"]["partial_json"] for _, e in got[6:8]) == '{"x": 1}'
    assert got[6][1]["index"] == 1 and got[8][1] == {"type": "content_block_stop", "index": 1}
    assert got[9][1]["delta"]["stop_reason"] == "tool_use"
    assert got[9][1]["usage"] == {
        "input_tokens": 9,
        "output_tokens": 5,
        "cache_read_input_tokens": 0,
    }
    assert stream.ended


def test_an_in_band_error_becomes_an_error_event_and_ends_the_stream():
    error = {"error": {"message": "died", "type": "server_error", "code": "upstream_failed"}}
    stream = MessagesStream()
    got = events(stream.feed(sse(chunk({"content": "a"}), error, b"[DONE]")))
    assert [name for name, _ in got] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert got[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "died"}}
    assert stream.feed(sse(chunk({"content": "late"}))) == b""


def test_an_empty_stream_still_starts_and_stops_the_message():
    got = events(MessagesStream().feed(sse(b"[DONE]")))
    assert [name for name, _ in got] == ["message_start", "message_delta", "message_stop"]


def _through_front(app, path: str = "/v1/messages", headers=()):  # noqa: ANN001, ANN202
    """What `messages_front` sends for `app`'s answer: (start message, body bytes), and the
    scope `app` saw."""
    import asyncio

    from gateway.serving.messages_edge import messages_front

    sent, seen = [], {}

    async def inner(scope, receive, send):  # noqa: ANN001, ANN202
        seen.update(scope)
        await app(scope, receive, send)

    async def send(message):  # noqa: ANN001, ANN202
        sent.append(message)

    async def receive():  # noqa: ANN202
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "path": path, "headers": list(headers)}
    asyncio.run(messages_front(inner)(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start, body, seen


def test_a_refusal_before_the_route_leaves_in_anthropics_shape():
    import random

    from gateway.capacity.door import _refusal

    async def door(scope, receive, send):  # noqa: ANN001, ANN202 (the door refusing)
        start, body = _refusal(random.Random(0), 1.0)
        await send(start)
        await send({"type": "http.response.body", "body": body})

    start, body, seen = _through_front(door, headers=[(b"x-api-key", b"sk-1")])
    assert (b"authorization", b"Bearer sk-1") in seen["headers"]
    decoded = json.loads(body)
    assert start["status"] == 429 and decoded["type"] == "error"
    assert decoded["error"]["type"] == "rate_limit_error" and decoded["error"]["message"]
    headers = dict(start["headers"])
    assert b"retry-after" in headers and int(headers[b"content-length"]) == len(body)
    # Another path's refusal, and an answer already in Anthropic's shape, pass unchanged.
    start, other, _ = _through_front(door, path="/v1/chat/completions")
    assert "type" not in json.loads(other) and json.loads(other)["error"]

    async def route(scope, receive, send):  # noqa: ANN001, ANN202
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b'{"type": "error", "error": {}}'})

    assert _through_front(route)[1] == b'{"type": "error", "error": {}}'
