"""`POST /v1/messages` with the real `anthropic` client against a real gateway in front of
the fake backend: messages, streams, the tool round trip's request, errors in Anthropic's
shape, x-api-key auth and a quota charged exactly what the client was told."""

import json

import anthropic
import httpx
import pytest

from tests.integration.gateway.conftest import gateway_stack
from tests.support.waiting import eventually

USER = [{"role": "user", "content": "hello there, model"}]


@pytest.fixture(scope="module")
def stack(redis_url):
    with gateway_stack(redis_url) as s:
        yield s


def client(stack, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key=key, max_retries=0, timeout=30)


def test_a_message_is_served_and_charged_what_its_usage_says(stack):
    key = stack.tenant("msg")
    message = client(stack, key).messages.create(
        model="small",
        max_tokens=5,
        system=[{"type": "text", "text": "be brief"}],
        messages=USER,
        stop_sequences=["\n\n"],
        metadata={"user_id": "u-1"},
        extra_body={"top_k": 5, "temperature": 0.5},  # fields this client version no longer names
    )
    assert message.type == "message" and message.role == "assistant"
    assert [(b.type, b.text) for b in message.content] == [("text", "sssss")]
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5 and message.usage.input_tokens > 0
    sent = stack.backends["small0"].bodies[-1]
    assert sent["messages"][0] == {"role": "system", "content": "be brief"}
    assert (sent["stop"], sent["top_k"], sent["user"]) == (["\n\n"], 5, "u-1")
    assert sent["temperature"] == 0.5
    told = message.usage.input_tokens + message.usage.output_tokens
    assert eventually(lambda: stack.charged("msg") == told)


def test_a_stream_gives_anthropic_events_and_exact_usage(stack):
    key = stack.tenant("stream")
    with client(stack, key).messages.stream(model="small", max_tokens=6, messages=USER) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "x" * 6
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert stack.backends["small0"].bodies[-1]["stream_options"] == {"include_usage": True}
    told = final.usage.input_tokens + final.usage.output_tokens
    assert final.usage.input_tokens > 0
    assert eventually(lambda: stack.charged("stream") == told)


def test_stream_events_have_event_and_data_lines_in_anthropic_order(stack):
    key = stack.tenant("events")
    body = {"model": "small", "max_tokens": 2, "messages": USER, "stream": True}
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{stack.url}/v1/messages", json=body, headers=headers) as r:
        raw = r.read().decode()
    events = [e.split("\n") for e in raw.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(
        json.loads(lines[1].removeprefix("data: "))["type"] == n
        for n, lines in zip(names, events, strict=True)
    )


def test_a_tool_round_trip_reaches_the_backend_as_chat_tool_calls(stack):
    key = stack.tenant("tools")
    client(stack, key).messages.create(
        model="small",
        max_tokens=3,
        tools=[
            {
                "name": "get_weather",
                "description": "the weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking it up."},
                    {
                        "type": "tool_use",
                        "id": "tu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "tu_1", "content": "sunny, 21 C"}
                ],
            },
        ],
    )
    sent = stack.backends["small0"].bodies[-1]
    assert sent["tools"][0]["function"]["parameters"]["properties"] == {"city": {"type": "string"}}
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    call = sent["messages"][1]["tool_calls"][0]
    assert (call["id"], call["function"]["name"]) == ("tu_1", "get_weather")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": "tu_1", "content": "sunny, 21 C"}


def test_an_unknown_field_is_a_400_naming_it_in_anthropic_shape(stack):
    key = stack.tenant("unknown")
    with pytest.raises(anthropic.BadRequestError) as top:
        client(stack, key).messages.create(
            model="small", max_tokens=3, messages=USER, extra_body={"thinking": {"type": "enabled"}}
        )
    assert top.value.status_code == 400
    assert top.value.body["type"] == "error"
    assert top.value.body["error"]["type"] == "invalid_request_error"
    assert "`thinking`" in top.value.body["error"]["message"]
    cached = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]
    with pytest.raises(anthropic.BadRequestError) as nested:
        client(stack, key).messages.create(model="small", max_tokens=3, messages=cached)
    assert "cache_control" in nested.value.body["error"]["message"]
    assert stack.charged("unknown") == 0


def test_an_exhausted_quota_is_a_429_rate_limit_error_with_retry_after(stack):
    key = stack.tenant("quota", tokens_per_minute=40)
    c = client(stack, key)
    c.messages.create(model="small", max_tokens=10, messages=USER)
    with pytest.raises(anthropic.RateLimitError) as refused:
        for _ in range(4):
            c.messages.create(model="small", max_tokens=10, messages=USER)
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 62


def test_keys_by_x_api_key_or_bearer_and_a_bad_key_is_a_401_authentication_error(stack):
    key = stack.tenant("auth")
    body = {"model": "small", "max_tokens": 2, "messages": USER}
    bearer = httpx.post(
        f"{stack.url}/v1/messages", json=body, headers={"authorization": f"Bearer {key}"}
    )
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    with pytest.raises(anthropic.AuthenticationError) as bad:
        client(stack, "sy-nope").messages.create(model="small", max_tokens=2, messages=USER)
    assert bad.value.status_code == 401
    assert bad.value.body["error"]["type"] == "authentication_error"
    missing = httpx.post(f"{stack.url}/v1/messages", json=body)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"


def test_an_unknown_model_is_a_not_found_error(stack):
    key = stack.tenant("nomodel")
    with pytest.raises(anthropic.NotFoundError) as missing:
        client(stack, key).messages.create(model="nope", max_tokens=2, messages=USER)
    assert missing.value.body["error"]["type"] == "not_found_error"


def test_a_worker_dying_mid_stream_ends_it_with_an_error_event(stack):
    key = stack.tenant("die")
    backend = stack.backends["small0"]
    backend.mode = "die_mid_stream"
    try:
        body = {"model": "small", "max_tokens": 10, "messages": USER, "stream": True}
        with httpx.stream(
            "POST", f"{stack.url}/v1/messages", json=body, headers={"x-api-key": key}
        ) as r:
            raw = r.read().decode()
    finally:
        backend.mode = "ok"
    last = raw.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: error"
    assert json.loads(last[1].removeprefix("data: "))["error"]["type"] == "api_error"
    assert "message_stop" not in raw


def test_model_auto_is_routed_as_for_chat(stack):
    key = stack.tenant("auto")
    r = httpx.post(
        f"{stack.url}/v1/messages",
        json={"model": "auto", "max_tokens": 2, "messages": USER},
        headers={"x-api-key": key},
    )
    assert r.status_code == 200 and r.headers["x-switchyard-model"] == "small"
    assert r.json()["content"] == [{"type": "text", "text": "ss"}]
