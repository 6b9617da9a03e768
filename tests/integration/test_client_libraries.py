"""The clients applications are built with, against a real gateway in front of a real
worker serving the default model (SmolLM2-135M-Instruct, whose chat template has no tool
support: tools go through the built-in tool prompt): LangChain (`langchain-openai`), the
OpenAI Agents SDK (`openai-agents`, on the Responses API) and the Anthropic client
(Messages API).

Each asserts what the application sees (a forced tool call that validates, an agent run to
completion, a conversation continued by `previous_response_id`) and that the tenant was
charged exactly the usage the client was told."""

import json
import tempfile

import httpx
import jsonschema
import pytest
import redis

from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.runtime.main import build_gateway
from tests.support.quota_books import tokens_charged
from tests.support.redis_server import redis_url as start_redis
from tests.support.servers import serving
from tests.support.waiting import eventually
from tests.support.worker import running_worker

ADMIN = "admin-clients"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}


class Gateway:
    def __init__(self, url: str, redis_url: str) -> None:
        self.url, self.redis_url = url, redis_url

    def tenant(self, tenant_id: str) -> str:
        admin = {"authorization": f"Bearer {ADMIN}"}
        r = httpx.post(f"{self.url}/admin/tenants", json={"tenant_id": tenant_id}, headers=admin)
        assert r.status_code == 201, r.text
        r = httpx.post(
            f"{self.url}/admin/tenants/{tenant_id}/keys", json={"name": "k"}, headers=admin
        )
        return r.json()["key"]

    def charged(self, tenant_id: str) -> int:
        return tokens_charged(self.redis_url, tenant_id)


@pytest.fixture(scope="module")
def gateway(real_model_dir):
    with (
        running_worker(real_model_dir) as worker,
        start_redis() as redis_url,
        tempfile.TemporaryDirectory() as data_dir,
    ):
        redis.Redis.from_url(redis_url).flushdb()
        cfg = GatewayConfig(
            pools={"small": [worker.url]},
            tokenizers={"small": str(real_model_dir)},
            data_dir=data_dir,
            admin_key=ADMIN,
            default_pool="small",
            load_poll_interval_s=0.05,
        )
        with serving(create_gateway_app(build_gateway(cfg, redis_url))) as url:
            assert eventually(lambda: httpx.get(f"{url}/ready").status_code == 200)
            yield Gateway(url, redis_url)


# -- the OpenAI Agents SDK (Responses API)


@pytest.fixture(scope="module")
def agents_key(gateway):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # its traces would go to OpenAI's servers
    return gateway.tenant("agents")


@pytest.fixture
def agents_model(gateway, agents_key):
    """A model over a client of its own (each run has its own event loop)."""
    import agents
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=agents_key, max_retries=0)
    return agents.OpenAIResponsesModel(model="small", openai_client=client)


def _answer_type():
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        summary: str = Field(max_length=16)

    return Answer


def _weather_agent(agents_model, calls: list[str]):
    from typing import Annotated

    import agents
    from pydantic import Field

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    # A forced first call (tool_choice reset to auto after it, the SDK's default); the
    # answer has a schema, so the model's last turn ends where the JSON does.
    return agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=agents_model,
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=80, temperature=0),
        output_type=_answer_type(),
    )


def test_an_agent_with_a_function_tool_runs_to_completion(gateway, agents_model):
    import agents

    calls: list[str] = []
    result = agents.Runner.run_sync(_weather_agent(agents_model, calls), "Weather in Paris?")
    # Forced, the first turn calls the tool (parallel calls allowed); every call validated.
    assert calls and all(len(city) <= 12 for city in calls)
    assert isinstance(result.final_output.summary, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item" and "tool_call_output_item" in kinds
    assert kinds[-1] == "message_output_item"
    told = sum(r.usage.total_tokens for r in result.raw_responses)
    assert eventually(lambda: gateway.charged("agents") == told)
    # The conversation goes on from the stored response, by its id alone.
    follow = agents.Agent(
        name="chat",
        model=agents_model,
        model_settings=agents.ModelSettings(max_tokens=40, temperature=0),
        output_type=_answer_type(),
    )
    later = agents.Runner.run_sync(
        follow, "And tomorrow?", previous_response_id=result.last_response_id
    )
    assert later.raw_responses[0].response_id != result.last_response_id
    assert eventually(
        lambda: (
            gateway.charged("agents")
            == told + sum(r.usage.total_tokens for r in later.raw_responses)
        )
    )


def test_a_streamed_agent_run_gives_its_events_and_the_same_kind_of_answer(agents_model):
    import asyncio

    import agents

    calls: list[str] = []

    async def run():
        streamed = agents.Runner.run_streamed(
            _weather_agent(agents_model, calls), "Weather in Rome?"
        )
        kinds = [e.type async for e in streamed.stream_events()]
        return streamed, kinds

    streamed, kinds = asyncio.run(run())
    assert calls and all(len(city) <= 12 for city in calls)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert isinstance(streamed.final_output.summary, str)


# -- LangChain (Chat Completions)


def _chat_model(gateway, tenant_id: str):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        model="small",
        base_url=f"{gateway.url}/v1",
        api_key=gateway.tenant(tenant_id),
        max_tokens=60,
        temperature=0,
        max_retries=0,
    )


@pytest.fixture(scope="module")
def chat_model(gateway):
    return _chat_model(gateway, "langchain")


def test_langchain_tool_calls_forced_and_auto(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import BaseModel, Field

    class get_weather(BaseModel):  # noqa: N801 (the tool's name, as LangChain takes it)
        """The weather in a city."""

        city: str = Field(max_length=12)

    forced = chat_model.bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    reply = forced.invoke([question])
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and len(call["args"]["city"]) <= 12
    # The tool loop: its result goes back and the model answers (auto: a call or text).
    answer = chat_model.bind_tools([get_weather]).invoke(
        [question, reply, ToolMessage(f"sunny in {call['args']['city']}", tool_call_id=call["id"])]
    )
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert answer.usage_metadata["input_tokens"] > 0


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_both_methods(chat_model, method):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)

    out = chat_model.with_structured_output(City, method=method).invoke("Name a city.")
    assert isinstance(out, City) and len(out.name) <= 12


def test_langchain_streams_chunks_with_usage_and_is_charged_it(gateway):
    chunks = list(_chat_model(gateway, "langchain-stream").stream("Say hello.", stream_usage=True))
    assert len(chunks) > 1
    usage = sum(chunks[1:], chunks[0]).usage_metadata
    # A token can end inside a character, so some tokens bring no text of their own.
    assert usage["output_tokens"] >= len([c for c in chunks if c.content]) > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert eventually(lambda: gateway.charged("langchain-stream") == usage["total_tokens"])


# -- the Anthropic client (Messages API)


@pytest.fixture(scope="module")
def anthropic_client(gateway):
    anthropic = pytest.importorskip("anthropic")
    key = gateway.tenant("anthropic")
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0, timeout=60)


def test_anthropic_message_stream_and_tool_use_round_trip(gateway, anthropic_client):
    hello = [{"role": "user", "content": "hello"}]
    message = anthropic_client.messages.create(
        model="small", max_tokens=6, messages=hello, extra_body={"temperature": 0}
    )
    assert message.content[0].type == "text" and message.usage.output_tokens >= 1
    # The same greedy answer, stopped by a piece of it, says which stop sequence it met.
    piece = message.content[0].text[1:3]
    assert len(piece) == 2
    stopped = anthropic_client.messages.create(
        model="small",
        max_tokens=6,
        messages=hello,
        extra_body={"temperature": 0},  # a field this client version no longer names
        stop_sequences=["zzz", piece],
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", piece)
    with anthropic_client.messages.stream(model="small", max_tokens=6, messages=hello) as s:
        streamed_text = "".join(s.text_stream)
        streamed = s.get_final_message()
    assert streamed_text == streamed.content[0].text
    tools = [{"name": "get_weather", "description": "the weather", "input_schema": WEATHER}]
    question = {"role": "user", "content": "Weather in Paris?"}
    use = anthropic_client.messages.create(
        model="small",
        max_tokens=60,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[question],
    )
    assert use.stop_reason == "tool_use"
    (block,) = [b for b in use.content if b.type == "tool_use"]
    jsonschema.validate(block.input, WEATHER)
    result = anthropic_client.messages.create(
        model="small",
        max_tokens=6,
        tools=tools,
        messages=[
            question,
            {"role": "assistant", "content": [b.model_dump() for b in use.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}],
            },
        ],
    )
    assert result.usage.input_tokens + result.usage.cache_read_input_tokens > 0
    told = sum(
        m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.output_tokens
        for m in (message, stopped, streamed, use, result)
    )
    assert eventually(lambda: gateway.charged("anthropic") == told)


def _closed(node):
    """A pydantic JSON schema whose models take no field beyond those they declare (the
    SDK's models allow extras, so an answer with a stray field would pass them); a free
    map (a tool's `input`) stays open."""
    if isinstance(node, dict):
        node = {k: _closed(v) for k, v in node.items()}
        if "properties" in node and node.get("additionalProperties") is True:
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_closed(v) for v in node]
    return node


def test_anthropic_answers_conform_to_the_sdks_types(gateway):
    """Anthropic publishes no OpenAPI document under a licence that can be vendored; its
    SDK's types are generated from it (MIT), so messages, each stream event and errors are
    validated against the JSON schemas of those types, closed to extra fields."""
    pydantic = pytest.importorskip("pydantic")
    from anthropic.types import Message, RawMessageStreamEvent
    from anthropic.types.shared import ErrorResponse

    def validator(schema):
        return jsonschema.Draft202012Validator(_closed(schema))

    message = validator(Message.model_json_schema())
    event = validator(pydantic.TypeAdapter(RawMessageStreamEvent).json_schema())
    error = validator(ErrorResponse.model_json_schema())
    headers = {"x-api-key": gateway.tenant("anthropic-schema")}
    base = {"model": "small", "max_tokens": 60, "messages": [{"role": "user", "content": "hi"}]}
    tools = {
        "tools": [{"name": "get_weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    kinds = set()
    for body in (base, {**base, **tools}, {**base, "stop_sequences": ["e"]}):
        r = httpx.post(f"{gateway.url}/v1/messages", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        message.validate(r.json())
        kinds.add(r.json()["stop_reason"])
        with httpx.stream(
            "POST",
            f"{gateway.url}/v1/messages",
            json={**body, "stream": True},
            headers=headers,
            timeout=60,
        ) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    event.validate(json.loads(line[6:]))
    assert "tool_use" in kinds
    bad = httpx.post(f"{gateway.url}/v1/messages", json={**base, "max_tokens": 0}, headers=headers)
    assert bad.status_code == 400
    error.validate(bad.json())
