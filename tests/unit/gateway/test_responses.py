"""The Responses API's translation to chat completions and back: pure functions and the
incremental stream, on plain data."""

import json

import pytest

from gateway.serving.responses import (
    ResponsesRequest,
    check,
    from_chat,
    items_of,
    output_messages,
    to_chat,
)
from gateway.serving.responses_stream import ResponsesStream
from workers.api.types import ApiError, decode_request


def request(**fields) -> ResponsesRequest:
    return decode_request(
        json.dumps({"model": "m", "input": "hi", **fields}).encode(), ResponsesRequest
    )


def test_a_request_becomes_the_chat_body_after_its_history():
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"}]
    req = request(
        instructions="be brief",
        input=[
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "two"}]},
        ],
        max_output_tokens=9,
        top_p=0.5,
        safety_identifier="u-1",
        text={"format": {"type": "json_object"}},
        include=["message.output_text.logprobs"],
        top_logprobs=3,
        stream=True,
    )
    assert to_chat(req, history) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            *history,
            {"role": "system", "content": "rules"},
            {"role": "user", "content": "two"},
        ],
        "max_tokens": 9,
        "top_p": 0.5,
        "response_format": {"type": "json_object"},
        "user": "u-1",
        "logprobs": True,
        "top_logprobs": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_function_calls_join_the_assistant_turn_and_outputs_become_tool_messages():
    req = request(
        input=[
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "g", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "a", "output": "A"},
            {
                "type": "function_call_output",
                "call_id": "b",
                "output": [{"type": "input_text", "text": "B"}],
            },
        ]
    )
    messages = to_chat(req, [])["messages"]
    assert [m["role"] for m in messages] == ["assistant", "tool", "tool"]
    assert [c["id"] for c in messages[0]["tool_calls"]] == ["a", "b"]
    assert messages[2] == {"role": "tool", "tool_call_id": "b", "content": "B"}


@pytest.mark.parametrize(
    ("item", "where"),
    [
        ({"type": "reasoning", "summary": []}, "$.input[1].type"),
        ({"role": "user", "content": "x", "cache": True}, "$.input[1]"),
        ({"role": "user", "content": [{"type": "input_audio"}]}, "$.input[1].content[0]"),
    ],
)
def test_an_item_that_is_not_supported_is_a_400_naming_where(item, where):
    req = request(input=[{"role": "user", "content": "ok"}, item])
    with pytest.raises(ApiError) as bad:
        items_of(req)
    assert bad.value.status == 400 and bad.value.param == "input"
    assert where in bad.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 4097}, "max_output_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_declared_values_this_server_cannot_honour_are_a_400(fields, param):
    with pytest.raises(ApiError) as bad:
        check(request(**fields), max_tokens_cap=4096)
    assert bad.value.param == param
    check(request(reasoning={"effort": None}, include=[]))  # neutral values pass


def chat_answer(message: dict, finish: str) -> dict:
    usage = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    usage["prompt_tokens_details"] = {"cached_tokens": 6}
    return {
        "model": "small",
        "choices": [{"message": message, "finish_reason": finish}],
        "usage": usage,
    }


def test_an_answer_becomes_output_items_and_they_replay_as_the_same_chat_turn():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = request(tools=[{"type": "function", "name": "f"}], user="u")
    response = from_chat(
        chat_answer({"content": "Looking.", "tool_calls": [call]}, "tool_calls"), req, "resp_1", 5
    )
    assert (response["id"], response["status"], response["model"]) == (
        "resp_1",
        "completed",
        "small",
    )
    assert [i["type"] for i in response["output"]] == ["message", "function_call"]
    assert response["output"][1]["call_id"] == "call_1"
    assert response["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 6, "cache_write_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 14,
    }
    assert response["tools"] == [
        {"type": "function", "name": "f", "description": None, "parameters": None, "strict": False}
    ]
    assert output_messages(response["output"]) == [
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]}
    ]
    cut = from_chat(chat_answer({"content": "Lo"}, "length"), req, "resp_2", 5)
    assert cut["status"] == "incomplete" and cut["output"][0]["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def sse(*chunks: object) -> bytes:
    return b"".join(
        b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n"
        for c in chunks
    )


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None):
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "c", "model": "small", "choices": choices, **({"usage": usage} if usage else {})}


def events(raw: bytes) -> list[dict]:
    out = []
    for event in raw.decode().strip().split("\n\n"):
        name, data = event.split("\n")
        decoded = json.loads(data.removeprefix("data: "))
        assert name == f"event: {decoded['type']}"
        out.append(decoded)
    return out


def test_a_stream_of_text_then_calls_becomes_the_event_sequence_fed_in_any_pieces():
    usage = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
    first = {"index": 0, "id": "call_a", "function": {"name": "f", "arguments": '{"x"'}}
    raw = sse(
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "He"}),
        chunk({"content": "llo"}),
        chunk({"tool_calls": [first]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "g"}}]}),
        chunk({}, finish="tool_calls"),
        chunk(usage=usage),
        b"[DONE]",
    )
    stream = ResponsesStream(request(), "resp_1", 5)
    got = events(b"".join(stream.feed(raw[i : i + 37]) for i in range(0, len(raw), 37)))
    assert [e["type"] for e in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []
    assert got[2]["item"]["status"] == "in_progress" and got[2]["item"]["content"] == []
    assert got[6]["text"] == "Hello" and got[12]["arguments"] == '{"x": 1}'
    assert got[15] | {"item_id": None} == {
        "type": "response.function_call_arguments.done",
        "item_id": None,
        "name": "g",
        "output_index": 2,
        "arguments": "",
        "sequence_number": 15,
    }
    final = got[-1]["response"]
    assert final == stream.response and stream.ended
    assert [(i["type"], i["status"]) for i in final["output"]] == [
        ("message", "completed"),
        ("function_call", "completed"),
        ("function_call", "completed"),
    ]
    assert [i.get("call_id") for i in final["output"]] == [None, "call_a", "call_b"]
    assert final["usage"]["total_tokens"] == 14 and final["model"] == "small"
    assert stream.feed(sse(chunk({"content": "late"}))) == b""


def test_an_in_band_error_ends_the_stream_with_response_failed():
    error = {"error": {"message": "died", "type": "server_error", "code": "upstream_failed"}}
    stream = ResponsesStream(request(), "resp_1", 5)
    got = events(stream.feed(sse(chunk({"content": "a"}), error, b"[DONE]")))
    assert [e["type"] for e in got][-3:] == [
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    failed = got[-1]["response"]
    assert failed["status"] == "failed" and failed["output"][0]["status"] == "incomplete"
    assert failed["error"] == {"code": "server_error", "message": "died"}
    limited = ResponsesStream(request(), "resp_2", 5)
    quota = {"error": {"message": "later", "type": "rate_limit_error"}}
    assert (
        events(limited.feed(sse(quota)))[-1]["response"]["error"]["code"] == "rate_limit_exceeded"
    )


def test_an_unreachable_store_is_a_503_with_retry_after_never_a_500():
    import asyncio
    import socket

    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from gateway.serving.responses_store import ResponseStore

    def free_port() -> int:  # nothing listens there once the socket is closed
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    async def attempt(call: str) -> ApiError:
        redis = Redis.from_url(
            f"redis://127.0.0.1:{free_port()}",
            socket_connect_timeout=1,
            retry=Retry(NoBackoff(), 0),
        )
        store = ResponseStore(redis, 60)
        try:
            with pytest.raises(ApiError) as refused:
                await getattr(store, call)("t", "resp_1")
        finally:
            await redis.aclose()
        return refused.value

    for call in ("load", "delete", "history"):
        err = asyncio.run(attempt(call))
        assert (err.status, err.code, err.retry_after_s) == (503, "store_unavailable", 1.0)
