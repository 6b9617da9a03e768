"""The built-in tool prompt: what a chat template without tool support is given, and that
its output is read back as calls."""

import json

from workers.api.tool_prompt import renders_tools, tool_prompt, with_tool_prompt
from workers.server.tools import ToolPlan, parse_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_only_a_template_mentioning_tools_renders_them_itself():
    assert renders_tools("{% if tools %}{{ tools }}{% endif %}")
    assert not renders_tools("{{ messages }}")
    assert not renders_tools(None)


def test_the_tool_block_lists_each_function_as_json_and_the_call_syntax():
    block = tool_prompt(TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in block
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        in block
    )


def test_the_tool_block_opens_the_first_system_message_or_is_a_new_one():
    user = {"role": "user", "content": "hi"}
    (system, rest) = with_tool_prompt([user], TOOLS)
    assert system == {"role": "system", "content": tool_prompt(TOOLS)} and rest == user
    out = with_tool_prompt([{"role": "system", "content": "Be brief."}, user], TOOLS)
    assert out[0]["content"] == tool_prompt(TOOLS) + "\n\nBe brief." and len(out) == 2


def test_calls_and_results_become_plain_turns_and_no_tools_means_no_block():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c1", "content": "rainy"},
        {"role": "user", "content": "thanks", "name": "ann"},
    ]
    assert with_tool_prompt(messages, None) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": f"Checking.\n{CALL_TEXT}\n{CALL_TEXT}"},
        {
            "role": "user",
            "content": "<tool_response>\nsunny\n</tool_response>\n"
            "<tool_response>\nrainy\n</tool_response>",
        },
        {"role": "user", "content": "thanks", "name": "ann"},
    ]


def test_a_call_written_as_the_prompt_says_is_read_back_as_a_call():
    plan = ToolPlan("qwen", TOOLS)
    content, calls = parse_calls("Sure. " + CALL_TEXT, plan)
    assert content == "Sure. " and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
