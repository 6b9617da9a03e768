"""Tool calling through the official `openai` client against a worker whose checkpoint has
a Qwen2-style tool template: forced calls always validate, streamed deltas reassemble,
`tool` messages are rendered back; and against a template without tools, which gets the
built-in tool prompt, the same."""

import json
from pathlib import Path

import pytest

from gateway.serving.prompt_tokens import PoolTokenizer, PromptCounter
from tests.support.checkpoints import with_chat_template
from tests.support.worker import running_worker
from workers.api.types import ChatCompletionRequest, decode_request
from workers.engine.tokenizer import CheckpointTokenizer
from workers.server.openai_format import chat_prompt
from workers.server.tools import plan_tools

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_dir(demo_dir, tmp_path_factory):
    return with_chat_template(demo_dir, tmp_path_factory.mktemp("tools") / "small")


@pytest.fixture(scope="module")
def client(tool_dir):
    with running_worker(tool_dir) as w:
        yield openai.OpenAI(base_url=f"{w.url}/v1", api_key="unused")


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_named_function_is_called_with_valid_arguments(client):
    for seed in range(3):
        done = client.chat.completions.create(
            model="small",
            messages=USER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        _valid(call.function.name, call.function.arguments)


def test_required_streams_each_call_whole_as_the_whole_answer_has_it(client):
    kw = dict(
        model="small",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=160,
        temperature=0.8,
        seed=4,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    num_argument_deltas = 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.function.name:
                call["name"] = d.function.name
            if d.function.arguments:
                call["arguments"] += d.function.arguments
                num_argument_deltas += 1
    # Each call is sent once it is whole: its first delta carries all its arguments.
    assert calls and num_argument_deltas == len(calls)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (w.function.name, w.function.arguments) for w in whole
    ]
    for c in calls.values():
        _valid(c["name"], c["arguments"])


def test_parallel_tool_calls_false_gives_one_call(client):
    done = client.chat.completions.create(
        model="small",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        seed=1,
    )
    assert len(done.choices[0].message.tool_calls) == 1


def _tool_result_round_trip(client, checkpoint: Path):  # noqa: ANN001, ANN202
    """A chat carrying an earlier call and its result, answered by the worker: (its answer,
    the prompt the worker renders for it, the gateway's count of it, the tokenizer)."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    done = client.chat.completions.create(
        model="small", messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=8
    )
    assert done.choices[0].message.role == "assistant"
    body = {"model": "small", "messages": messages, "tools": TOOLS}
    req = decode_request(json.dumps(body).encode(), ChatCompletionRequest)
    tok = CheckpointTokenizer(checkpoint)
    prompt = chat_prompt(req, tok, plan_tools(req, tok.chat_template))
    counter = PromptCounter({"small": PoolTokenizer(str(checkpoint))})
    counted = counter.chat("small", req.messages, req.tools, req.tool_choice)
    return done, prompt, counted, tok


def test_a_tool_result_is_rendered_back_and_answered(client, tool_dir):
    _, prompt, counted, tok = _tool_result_round_trip(client, tool_dir)
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '"name": "get_time"' in prompt  # the tools themselves
    # The gateway counts what the worker renders, tools included.
    assert counted == len(tok.encode(prompt, add_special_tokens=False))


@pytest.fixture(scope="module")
def plain(demo_dir):
    """A worker whose template has no tool support: the built-in tool prompt stands in."""
    with running_worker(demo_dir) as w:
        yield openai.OpenAI(base_url=f"{w.url}/v1", api_key="unused")


def test_a_template_without_tools_answers_forced_calls_with_valid_arguments(plain):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        done = plain.chat.completions.create(
            model="small", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=120, seed=2
        )
        assert done.choices[0].finish_reason == "tool_calls"
        calls = done.choices[0].message.tool_calls
        assert calls and all(c.id.startswith("call_") for c in calls)
        if choice is named:
            assert [c.function.name for c in calls] == ["get_weather"]
        for c in calls:
            _valid(c.function.name, c.function.arguments)


def test_a_template_without_tools_streams_the_calls_of_the_whole_answer(plain):
    kw = dict(
        model="small", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=160, seed=4
    )
    whole = plain.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    for chunk in plain.chat.completions.create(**kw, stream=True):
        for d in (chunk.choices[0].delta.tool_calls if chunk.choices else None) or []:
            call = calls.setdefault(d.index, {"name": None, "arguments": ""})
            call["name"] = d.function.name or call["name"]
            call["arguments"] += d.function.arguments or ""
    assert whole and [(c["name"], c["arguments"]) for c in calls.values()] == [
        (w.function.name, w.function.arguments) for w in whole
    ]


def test_a_template_without_tools_renders_a_tool_result_back_as_the_gateway_counts(plain, demo_dir):
    done, prompt, counted, tok = _tool_result_round_trip(plain, demo_dir)
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tools>" in prompt and '"name": "get_time"' in prompt
    assert counted == len(tok.encode(prompt, add_special_tokens=False))
    assert counted == done.usage.prompt_tokens


def test_an_unknown_named_function_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="small",
            messages=USER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert exc.value.body["param"] == "tool_choice"


def test_a_forced_call_cut_short_by_max_tokens_is_text_not_a_call(client):
    """Truncated arguments never reach `tool_calls`, whole or streamed: the partial JSON
    is the message's content and the finish reason is `length`."""
    kw = dict(
        model="small",
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=3,
        temperature=0,
    )
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls
    assert choice.message.content.startswith("{")
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
