"""Tool calling: what the chat template is given, what the output is constrained to, and
how the output is read back into OpenAI `tool_calls`.

- Tools are rendered by the checkpoint's own chat template (`apply_chat_template(tools=)`);
  a template that never mentions `tools` cannot show them to the model: 400.
- `tool_choice`: `none` renders no tools and parses nothing; `auto` lets the model write
  its family's call format, parsed afterwards; a named function constrains the output to
  that function's arguments (its JSON schema); `required` constrains it to a JSON array
  of `{"name", "arguments"}` calls (one, unless `parallel_tool_calls`). Forced calls are
  therefore always valid, whatever the model.
- Output formats (`auto`): Qwen2/Qwen3/Hermes `<tool_call>{json}</tool_call>`, Llama 3
  a bare JSON object (`parameters` or `arguments`, optionally after `<|python_tag|>`,
  several separated by `;`), Mistral `[TOOL_CALLS][{...}, ...]`.
- `parse_calls` reads the whole text so far and returns the content and the calls seen,
  each call's arguments as far as they have been generated. Streaming re-parses the
  text at each token (outputs are short) and sends what is new (`ToolStream`).
"""

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from workers.api.types import ApiError, ChatCompletionRequest, NamedToolChoice
from workers.engine.structured import GrammarSpec

_QWEN, _LLAMA, _MISTRAL = "qwen", "llama", "mistral"
_NAMED, _REQUIRED = "named", "required"  # forced formats (constrained JSON)
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_MARKERS = {_QWEN: "<tool_call>", _MISTRAL: "[TOOL_CALLS]", _LLAMA: "<|python_tag|>"}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""

    format: str  # qwen | llama | mistral (auto), named | required (forced)
    tools: list[dict[str, Any]]  # for the chat template, OpenAI shape
    named: str | None = None


def template_family(template: str) -> str | None:
    """The call format a chat template teaches; None when it has no tool support."""
    if "tools" not in template:
        return None
    if "[TOOL_CALLS]" in template:
        return _MISTRAL
    if "<tool_call>" in template:
        return _QWEN
    return _LLAMA


def plan_tools(req: ChatCompletionRequest, template: str | None) -> ToolPlan | None:
    """None when the request uses no tools (none given, or `tool_choice: none`)."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    family = template_family(template or "")
    if family is None:
        raise ApiError(
            400,
            "this model's chat template has no tool support; send the request without tools",
            param="tools",
            code="tools_not_supported",
        )
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tool function names must be unique", param="tools")
    tools = [{"type": "function", "function": _function_dict(t.function)} for t in req.tools]
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ApiError(
                400,
                f"tool_choice names an unknown function {choice.function.name!r}",
                param="tool_choice",
            )
        return ToolPlan(_NAMED, tools, choice.function.name)
    if choice == "required":
        return ToolPlan(_REQUIRED, tools)
    return ToolPlan(family, tools)


def _function_dict(f: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        out["description"] = f.description
    out["parameters"] = f.parameters if f.parameters is not None else {"type": "object"}
    return out


def tool_grammar(plan: ToolPlan, parallel: bool) -> GrammarSpec | None:
    """The constraint of a forced tool choice; None for `auto`."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in plan.tools}
    if plan.format == _NAMED:
        assert plan.named is not None
        return GrammarSpec.from_schema(params[plan.named], "tools")
    if plan.format != _REQUIRED:
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in params.items()
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return GrammarSpec.from_schema(array, "tools")


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Extra fields of the messages for a template: earlier calls (arguments as objects,
    as templates expect) and the call id a `tool` message answers. Content is set later."""
    out = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": m.role}
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _loads(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass
class Call:
    name: str
    arguments: str  # as far as generated
    complete: bool


def _object_end(text: str, start: int) -> int | None:
    """Index just past the JSON object starting at `text[start]`, None when it is open."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            esc, in_str = (False, in_str) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _calls_in(text: str, sep: str) -> list[Call]:
    """Calls `{"name": …, "arguments": {…}}` one after another, separated by `sep` chars."""
    calls: list[Call] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos] in sep or text[pos].isspace()):
            pos += 1
        head = _HEAD.match(text, pos)
        if head is None:
            return calls
        name = json.loads(f'"{head.group(1)}"')
        start = head.end()
        if start >= len(text):
            calls.append(Call(name, "", False))
            return calls
        end = _object_end(text, start) if text[start] in "{[" else None
        if end is None:
            calls.append(Call(name, text[start:].rstrip(), False))
            return calls
        calls.append(Call(name, text[start:end], True))
        close = text.find("}", end)
        if close < 0:
            return calls
        pos = close + 1


def _held_prefix(text: str, marker: str) -> int:
    """Characters at the end of `text` that could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def parse_calls(text: str, fmt: str, named: str | None = None) -> tuple[str, list[Call]]:
    """(content safe to show, calls so far) of a generated text."""
    if fmt == _NAMED:
        return "", [Call(named or "", text, False)]
    if fmt == _REQUIRED:
        return "", _calls_in(text[1:] if text.startswith("[") else "", ",")
    if fmt == _LLAMA:
        body = text.lstrip()
        if body.startswith(_MARKERS[_LLAMA]):
            body = body[len(_MARKERS[_LLAMA]) :]
        if not body.strip():
            return "", []
        if body.lstrip().startswith("{"):
            return "", _calls_in(body, ";")
        return text, []
    marker = _MARKERS[fmt]
    at = text.find(marker)
    if at < 0:
        return text[: len(text) - _held_prefix(text, marker)], []
    rest = text[at + len(marker) :]
    if fmt == _MISTRAL:
        return text[:at], _calls_in(rest.lstrip()[1:] if rest.lstrip().startswith("[") else "", ",")
    calls = []
    for part in rest.split(marker):
        calls += _calls_in(part.split("</tool_call>")[0], "")
    return text[:at], calls


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolStream:
    """One choice's tool-call reader: full text in, OpenAI deltas out."""

    plan: ToolPlan
    text: str = ""
    sent_content: int = 0
    sent_args: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def push(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and `tool_calls` deltas that `delta` makes visible."""
        self.text += delta
        content, calls = parse_calls(self.text, self.plan.format, self.plan.named)
        new_content = content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(content))
        out = []
        for i, call in enumerate(calls):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                out.append(
                    {
                        "index": i,
                        "id": self.ids[i],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            args = call.arguments[self.sent_args[i] :]
            if args:
                self.sent_args[i] = len(call.arguments)
                out.append({"index": i, "function": {"arguments": args}})
        return new_content, out

    def flush(self) -> str:
        """Content held back (a possible marker prefix) once the text is known to be whole."""
        content, calls = parse_calls(self.text, self.plan.format, self.plan.named)
        if calls:
            return ""
        rest = self.text[self.sent_content :]
        self.sent_content = len(self.text)
        return rest

    def calls(self) -> list[dict[str, Any]]:
        """The final `message.tool_calls` (empty when the text holds none)."""
        _, calls = parse_calls(self.text, self.plan.format, self.plan.named)
        while len(self.ids) < len(calls):
            self.ids.append(new_call_id())
        return [
            {
                "id": self.ids[i],
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(calls)
        ]

    def content(self) -> str | None:
        content, calls = parse_calls(self.text, self.plan.format, self.plan.named)
        if not calls:
            return self.text
        return content or None
