"""Tools for a chat template that cannot render them: the built-in tool prompt.

A template that never mentions `tools` shows the model neither the functions nor earlier
calls and their results. For such a template the chat is rewritten, before it is rendered,
into plain system, user and assistant messages (Qwen/Hermes style, so the output is read
back as the `qwen` format):

- the tools, as JSON schema, and the call syntax, in a system block (`tool_prompt`) put
  before the first system message's content, or as a new first system message;
- an assistant message's `tool_calls` appended to its content as
  `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`, one a call;
- `tool` messages as a user message, each result wrapped in
  `<tool_response>\\n…\\n</tool_response>` (consecutive results in one message).

Pure: both the worker (to build the prompt) and the gateway (to count it) render with it,
so the gateway's count is the worker's prompt.
"""

import json
from typing import Any

_TOOL_PROMPT_HEAD = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
"""
_TOOL_PROMPT_TAIL = """
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""


def renders_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it mentions `tools`); else the chat
    goes through `with_tool_prompt`."""
    return template is not None and "tools" in template


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The system block that shows `tools` (OpenAI shape) and how to call them."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return _TOOL_PROMPT_HEAD + lines + _TOOL_PROMPT_TAIL


def call_text(name: str, arguments: Any) -> str:
    """One call as the model is told to write it; `arguments` an object (or the client's
    text when it was not JSON)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` as a template without tool support can render them: `role`, text
    `content` (and `name`) only. `messages` are template-shaped: `content` text,
    `tool_calls` with `function.arguments` as objects. `tools` None or empty: no tool
    block (`tool_choice: none`), earlier calls and results are still rewritten."""
    out: list[dict[str, Any]] = []
    after_result = False  # the last message out is tool results: the next one joins it
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if after_result:
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            after_result = True
            continue
        after_result = False
        calls = [
            call_text(c["function"]["name"], c["function"]["arguments"])
            for c in m.get("tool_calls") or []
        ]
        msg = {"role": m["role"], "content": "\n".join(([content] if content else []) + calls)}
        if m.get("name") is not None:
            msg["name"] = m["name"]
        out.append(msg)
    if tools:
        block = tool_prompt(tools)
        system = next((m for m in out if m["role"] == "system"), None)
        if system is None:
            out.insert(0, {"role": "system", "content": block})
        else:
            system["content"] = block + ("\n\n" + system["content"] if system["content"] else "")
    return out
