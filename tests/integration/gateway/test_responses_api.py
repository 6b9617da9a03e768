"""`POST /v1/responses` with the real `openai` client against a real gateway in front of the
fake backend: responses, streams with the Responses event sequence, stored responses
continued with `previous_response_id` (per tenant, deleted and expired), the chat body each
becomes, strict fields, errors in OpenAI's shape and a quota charged exactly what the
client was told."""

import json

import httpx
import openai
import pytest
import redis

from gateway.serving.responses_store import key as stored_key
from tests.integration.gateway.conftest import gateway_stack
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def stack(redis_url):
    with gateway_stack(redis_url) as s:
        yield s


def client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=30)


def sent(stack) -> dict:
    return stack.backends["small0"].bodies[-1]


def test_a_response_is_served_and_charged_what_its_usage_says(stack):
    key = stack.tenant("resp")
    response = client(stack, key).responses.create(
        model="small",
        instructions="be brief",
        input="hello there, model",
        max_output_tokens=5,
        temperature=0.5,
        metadata={"run": "1"},
        store=False,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == "sssss"
    assert response.status == "incomplete"  # the fake backend stops at max_tokens
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.metadata == {"run": "1"} and response.instructions == "be brief"
    body = sent(stack)
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there, model"},
    ]
    assert (body["max_tokens"], body["temperature"]) == (5, 0.5)
    usage = response.usage
    assert usage.output_tokens == 5 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert eventually(lambda: stack.charged("resp") == usage.total_tokens)
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client(stack, key).responses.retrieve(response.id)


def test_a_stream_gives_the_responses_events_in_order_and_exact_usage(stack):
    key = stack.tenant("rstream")
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": "small", "input": "hi", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/responses", json=body, headers=headers) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e.split("\n") for e in raw.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    data = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert [d["type"] for d in data] == names
    assert [d["sequence_number"] for d in data] == list(range(len(names)))
    final = data[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "xx"
    assert final["usage"]["output_tokens"] == 2
    assert sent(stack)["stream_options"] == {"include_usage": True}
    assert eventually(lambda: stack.charged("rstream") == final["usage"]["total_tokens"])
    # The stored response is the one the stream ended with.
    stored = client(stack, key).responses.retrieve(final["id"])
    assert (
        stored.output_text == "xx" and stored.usage.total_tokens == final["usage"]["total_tokens"]
    )


def test_the_openai_client_streams_text_deltas_and_the_final_response(stack):
    key = stack.tenant("rsdk")
    events = list(
        client(stack, key).responses.create(
            model="small", input="hi", max_output_tokens=4, stream=True
        )
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete"  # the fake backend stops at max_tokens
    assert "".join(deltas) == "xxxx" == events[-1].response.output_text


def test_previous_response_id_continues_the_tenants_own_conversation(stack):
    key = stack.tenant("conv")
    c = client(stack, key)
    first = c.responses.create(
        model="small", instructions="rule one", input="one", max_output_tokens=2
    )
    second = c.responses.create(
        model="small",
        previous_response_id=first.id,
        instructions="rule two",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "two"}]}],
        max_output_tokens=3,
    )
    # The first one's instructions are not carried over; its input and output are.
    assert sent(stack)["messages"] == [
        {"role": "system", "content": "rule two"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "ss"},
        {"role": "user", "content": "two"},
    ]
    assert second.previous_response_id == first.id
    assert c.responses.retrieve(second.id).output_text == "sss"
    # Another tenant can neither read, continue nor delete it.
    other = client(stack, stack.tenant("conv-other"))
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as continued:
        other.responses.create(model="small", previous_response_id=first.id, input="x")
    assert continued.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first.id)
    assert stack.charged("conv-other") == 0
    # Deleted, it is gone; what the store keeps expires at the configured retention.
    with redis.Redis.from_url(stack.redis_url) as r:
        assert (
            0 < r.ttl(stored_key("conv", second.id)) <= stack.gateway.config.responses_retention_s
        )
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)


def test_tools_function_calls_and_their_outputs_reach_the_backend_as_chat(stack):
    key = stack.tenant("rtools")
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    client(stack, key).responses.create(
        model="small",
        max_output_tokens=3,
        tools=[
            {
                "type": "function",
                "name": "get_weather",
                "description": "the weather in a city",
                "parameters": weather,
                "strict": True,
            }
        ],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "answer", "schema": weather}},
        input=[
            {"role": "developer", "content": "use the tools"},
            {"role": "user", "content": "weather in Paris and Rome?"},
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
                "status": "completed",
            },
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "get_weather",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
        ],
    )
    body = sent(stack)
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "the weather in a city",
                "parameters": weather,
                "strict": True,
            },
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": weather},
    }
    messages = body["messages"]
    assert messages[0] == {"role": "system", "content": "use the tools"}
    assert messages[2]["content"] == "Looking."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[3:] == [
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ],
)
def test_an_unsupported_field_or_value_is_a_400_naming_it_and_charges_nothing(stack, extra, named):
    key = stack.tenant(f"bad-{named}-{len(str(extra))}")
    body = {"model": "small", "input": "hi", "max_output_tokens": 2, **extra}
    r = httpx.post(
        f"{stack.url}/v1/responses", json=body, headers={"authorization": f"Bearer {key}"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == named or named in error["message"], error
    assert stack.charged(f"bad-{named}-{len(str(extra))}") == 0


def test_refusals_are_openai_errors_with_retry_after(stack):
    key = stack.tenant("rquota", tokens_per_minute=40)
    c = client(stack, key)
    c.responses.create(model="small", input="hi", max_output_tokens=10, store=False)
    with pytest.raises(openai.RateLimitError) as refused:
        for _ in range(4):
            c.responses.create(model="small", input="hi", max_output_tokens=10, store=False)
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 62
    with pytest.raises(openai.AuthenticationError):
        client(stack, "sy-nope").responses.create(model="small", input="hi")
    with pytest.raises(openai.NotFoundError):
        client(stack, key).responses.create(model="nope", input="hi")


def test_a_worker_dying_mid_stream_ends_it_with_response_failed(stack):
    key = stack.tenant("rdie")
    backend = stack.backends["small0"]
    backend.mode = "die_mid_stream"
    try:
        body = {"model": "small", "input": "hi", "max_output_tokens": 10, "stream": True}
        headers = {"authorization": f"Bearer {key}"}
        with httpx.stream("POST", f"{stack.url}/v1/responses", json=body, headers=headers) as r:
            raw = r.read().decode()
    finally:
        backend.mode = "ok"
    last = raw.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: response.failed"
    failed = json.loads(last[1].removeprefix("data: "))["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "response.completed" not in raw


def test_model_auto_is_routed_as_for_chat(stack):
    key = stack.tenant("rauto")
    r = httpx.post(
        f"{stack.url}/v1/responses",
        json={"model": "auto", "input": "hi", "max_output_tokens": 2},
        headers={"authorization": f"Bearer {key}"},
    )
    assert r.status_code == 200 and r.headers["x-switchyard-model"] == "small"
    assert r.json()["output"][0]["content"][0]["text"] == "ss"
