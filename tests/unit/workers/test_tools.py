"""Reading tool calls out of generated text, whole and streamed, per template family."""

import json

import pytest

from workers.api.types import ApiError, ChatCompletionRequest, decode_request
from workers.server.tools import (
    ToolPlan,
    ToolStream,
    parse_calls,
    plan_tools,
    template_family,
    tool_grammar,
)

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
QWEN = f"Let me check.<tool_call>\n{CALL}\n</tool_call>"
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL = f'[TOOL_CALLS][{CALL}, {{"name": "t", "arguments": {{}}}}]'
PARIS = ("get_weather", {"city": "Paris"})
NESTED = '[{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}]'
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "t", "f")]
QWEN_TEMPLATE = "{% if tools %}<tool_call>{% endif %}"


@pytest.mark.parametrize(
    "fmt, text, content, calls",
    [
        ("qwen", QWEN, "Let me check.", [("get_weather", {"city": "Paris"})]),
        ("llama", LLAMA, "", [("get_weather", {"city": "Paris"})]),
        (
            "llama",
            "<|python_tag|>" + LLAMA + "; " + LLAMA,
            "",
            [("get_weather", {"city": "Paris"})] * 2,
        ),
        ("mistral", MISTRAL, "", [("get_weather", {"city": "Paris"}), ("t", {})]),
        ("qwen", "no calls here", "no calls here", []),
        (
            "required",
            '[{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}]',
            "",
            [("f", {"a": [1, {"b": "}"}]})],
        ),
    ],
)
def test_calls_are_parsed_per_family(fmt, text, content, calls):
    got_content, got = parse_calls(text, ToolPlan(fmt, TOOLS))
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("fmt, text", [("qwen", QWEN), ("llama", LLAMA), ("mistral", MISTRAL)])
def test_streamed_deltas_reassemble_to_the_whole_parse(fmt, text):
    stream = ToolStream(ToolPlan(fmt, TOOLS))
    content, calls = "", {}
    for ch in text:  # one character per step: the hardest split
        c, deltas = stream.push(ch)
        content += c
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            if "id" in d:
                call["name"] = d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    content += stream.flush()
    want_content, want = parse_calls(text, ToolPlan(fmt, TOOLS))
    assert content == want_content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (w.name, w.arguments) for w in want
    ]


def test_a_marker_prefix_is_held_back_until_it_resolves():
    stream = ToolStream(ToolPlan("qwen", []))
    assert stream.push("hi <tool")[0] == "hi "
    assert stream.push("s are nice")[0] == "<tools are nice"


def test_a_template_without_tools_gets_the_built_in_prompt_read_as_qwen():
    """No 400: the built-in tool prompt teaches `<tool_call>`; forced calls stay forced."""
    named = {"type": "function", "function": {"name": "f"}}
    plans = [
        plan_tools(_request(tools=TOOLS, **fields), "{{ messages }}")
        for fields in ({}, {"tool_choice": "required"}, {"tool_choice": named})
    ]
    assert [p.format for p in plans if p] == ["qwen", "required", "named"]
    assert plan_tools(_request(tools=TOOLS, tool_choice="none"), None) is None


def test_a_template_with_its_own_tool_format_keeps_it():
    plan = plan_tools(_request(tools=TOOLS), "{% if tools %}[TOOL_CALLS]{% endif %}")
    assert plan is not None and plan.format == "mistral"


def test_template_family_from_the_template_text():
    assert template_family("{{ messages }}") is None
    assert template_family("{% if tools %}<tool_call>{% endif %}") == "qwen"
    assert template_family("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert template_family("{% if tools %}<|python_tag|>{% endif %}") == "llama"


def _request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest)


def test_a_function_whose_arguments_are_not_an_object_is_a_400():
    """Arguments are a JSON object: a forced call of any other schema could never be one."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    with pytest.raises(ApiError) as exc:
        plan_tools(_request(tools=tools, tool_choice="required"), QWEN_TEMPLATE)
    assert exc.value.param == "tools"


def test_a_forced_call_is_constrained_to_an_object():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}]
    named = {"type": "function", "function": {"name": "f"}}
    plan = plan_tools(_request(tools=tools, tool_choice=named), QWEN_TEMPLATE)
    assert plan is not None
    grammar = tool_grammar(plan, parallel=True)
    assert grammar is not None and json.loads(grammar.schema_json) == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }


def test_forced_arguments_take_only_declared_properties_unless_the_schema_says_otherwise():
    """An object with `properties` and no `additionalProperties` is closed, at any depth
    (nested, in arrays, in anyOf, in $defs); one that says either way is left as it is."""
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    params = {
        "properties": {
            "at": point,
            "path": {"type": "array", "items": point},
            "either": {"anyOf": [point, {"type": "string"}]},
            "ref": {"$ref": "#/$defs/p"},
            "extra": {"type": "object", "properties": {}, "additionalProperties": True},
            "tags": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "$defs": {"p": point},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    named = {"type": "function", "function": {"name": "f"}}
    plan = plan_tools(_request(tools=tools, tool_choice=named), QWEN_TEMPLATE)
    assert plan is not None
    grammar = tool_grammar(plan, parallel=True)
    assert grammar is not None
    schema = json.loads(grammar.schema_json)
    closed_point = {**point, "additionalProperties": False}
    props = schema["properties"]
    assert schema["additionalProperties"] is False
    assert props["at"] == props["path"]["items"] == props["either"]["anyOf"][0] == closed_point
    assert schema["$defs"]["p"] == closed_point
    assert props["extra"]["additionalProperties"] is True
    assert props["tags"] == {"type": "object", "additionalProperties": {"type": "string"}}
    assert "additionalProperties" not in point  # the request's own schema is not changed


def test_the_plan_allows_one_call_unless_parallel_tool_calls():
    named = {"type": "function", "function": {"name": "f"}}
    plans = [
        plan_tools(_request(tools=TOOLS[2:], **fields), QWEN_TEMPLATE)
        for fields in ({}, {"parallel_tool_calls": False}, {"tool_choice": named})
    ]
    assert [(p.format, p.parallel) for p in plans if p] == [
        ("qwen", True),
        ("qwen", False),
        ("named", False),
    ]
