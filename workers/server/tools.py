"""Tool calling: what the chat template is given, what the output is constrained to, and
how the output is read back into OpenAI `tool_calls`.

- Tools are rendered by the checkpoint's own chat template (`apply_chat_template(tools=)`)
  where it has tool support; a template that never mentions `tools` gets the built-in
  tool prompt (`workers.api.tool_prompt`) and is read back in the Qwen/Hermes format.
- `tool_choice`: `none` renders no tools and parses nothing; `auto` lets the model write
  its family's call format, parsed afterwards; a named function constrains the output to
  that function's arguments (its JSON schema); `required` constrains it to a JSON array
  of `{"name", "arguments"}` calls (one, unless `parallel_tool_calls`). Forced calls are
  therefore always valid, whatever the model. An object in the arguments' schema that
  does not say `additionalProperties` takes only its listed properties (`closed`, as
  xgrammar's strict mode does): a function takes no argument it does not declare, and an
  open object would let a weak model add keys until `max_tokens` cuts the call.
- Output formats (`auto`): Qwen2/Qwen3/Hermes `<tool_call>{json}</tool_call>`, Llama 3
  a bare JSON object (`parameters` or `arguments`, optionally after `<|python_tag|>`,
  several separated by `;`), Mistral `[TOOL_CALLS][{...}, ...]`.
- `read_pieces` cuts the output into content, calls and the frames around calls. A call
  counts only when its JSON object is whole and valid, names a function the request
  declared, has an object of arguments, and is within `parallel_tool_calls`; anything
  else where a call could be (an undeclared name, arguments cut short by `max_tokens`,
  not JSON, not an object) is content, in every format, forced ones included.
- Streaming (`ToolStream`) reads the text as it grows, from where it is still undecided
  (each character once), and sends what has become certain: a call once it is whole, in
  one delta; text once it cannot be part of a call; at the end, what is still undecided,
  as content. A streamed answer therefore has the content and calls of the whole one.
"""

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from workers.api.tool_prompt import renders_tools
from workers.api.types import ApiError, ChatCompletionRequest, NamedToolChoice
from workers.engine.structured import GrammarSpec

_QWEN, _LLAMA, _MISTRAL = "qwen", "llama", "mistral"
_NAMED, _REQUIRED = "named", "required"  # forced formats (constrained JSON)


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""

    format: str  # qwen | llama | mistral (auto), named | required (forced)
    tools: list[dict[str, Any]]  # for the chat template, OpenAI shape
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True  # more than one call may be answered (parallel_tool_calls)


def template_family(template: str) -> str | None:
    """The call format a chat template teaches; None when it has no tool support (the
    built-in tool prompt, read as `qwen`, stands in)."""
    if not renders_tools(template):
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
    family = template_family(template or "") or _QWEN
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tool function names must be unique", param="tools")
    for t in req.tools:
        if (t.function.parameters or {}).get("type", "object") != "object":
            raise ApiError(
                400,
                f"the parameters of {t.function.name!r} must be a JSON schema of type object",
                param="tools",
            )
    tools = [{"type": "function", "function": _function_dict(t.function)} for t in req.tools]
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ApiError(
                400,
                f"tool_choice names an unknown function {choice.function.name!r}",
                param="tool_choice",
            )
        return ToolPlan(_NAMED, tools, choice.function.name, parallel=False)
    if choice == "required":
        return ToolPlan(_REQUIRED, tools, parallel=req.parallel_tool_calls)
    return ToolPlan(family, tools, parallel=req.parallel_tool_calls)


def _function_dict(f: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        out["description"] = f.description
    out["parameters"] = f.parameters if f.parameters is not None else {"type": "object"}
    return out


def tool_grammar(plan: ToolPlan, parallel: bool) -> GrammarSpec | None:
    """The constraint of a forced tool choice; None for `auto`. Arguments are objects, also
    where a schema does not say so."""
    params = {
        t["function"]["name"]: closed({"type": "object", **t["function"]["parameters"]})
        for t in plan.tools
    }
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


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed(schema: Any) -> Any:
    """A copy of `schema` in which every object with `properties` and no
    `additionalProperties` has `additionalProperties: false`; nothing else changes."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


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


@dataclass(frozen=True, slots=True)
class Call:
    name: str  # a function the request declared
    arguments: str  # its arguments: a whole JSON object, as generated


_CONTENT, _CALL, _DROP, _OPEN = "content", "call", "drop", "open"


@dataclass(frozen=True, slots=True)
class Piece:
    """`text[start:end]` of an output and what it is: `content` (text for the client),
    `call` (a whole call of a declared function), `drop` (markers, brackets, separators and
    whitespace framing calls), `open` (undecided until more text comes; always last)."""

    start: int
    end: int
    kind: str
    call: Call | None = None


@dataclass(frozen=True, slots=True)
class _Syntax:
    """How a format frames its calls. A frame is a run of literal tokens, whitespace
    allowed around them; an opening or in-between frame counts only when a JSON object
    follows it, a closing one only when it is whole."""

    opens: tuple[tuple[str, ...], ...]  # before the first call, alternatives in order
    between: tuple[str, ...] | None  # between two calls; None: a single call
    close: tuple[str, ...]  # after the last call
    anywhere: bool  # calls may come after content (opens[0][0] marks them); else only first


_SYNTAX = {
    _QWEN: _Syntax((("<tool_call>",),), ("</tool_call>", "<tool_call>"), ("</tool_call>",), True),
    _MISTRAL: _Syntax((("[TOOL_CALLS]", "["), ("[TOOL_CALLS]",)), (",",), ("]",), True),
    _LLAMA: _Syntax((("<|python_tag|>",), ()), (";",), (), False),
    _REQUIRED: _Syntax((("[",),), (",",), ("]",), False),
    _NAMED: _Syntax(((),), None, (), False),
}
_PARTIAL = -1  # a frame the text ends inside: undecided
_WS = re.compile(r"\s*")
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)  # up to a string's end quote
_STRUCTURE = re.compile(r'["{}\[\]]')
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_TOP, _OBJECT, _AFTER, _TAIL = "top", "object", "after", "tail"

Reader = Callable[[str], Call | None]


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where reading a growing text resumes: the pieces before `pos` are read for good."""

    pos: int = 0
    # top: content, or where calls open; object: a call's object starts at pos;
    # after: one ended at pos (frames next); tail: content to the end
    state: str = _TOP
    num_calls: int = 0  # calls before pos
    scan: tuple[int, int, bool] = (0, 0, False)  # object: (scanned to, depth, in a string)


def read_pieces(
    text: str, plan: ToolPlan, final: bool, at: Cursor = Cursor()
) -> tuple[list[Piece], Cursor]:
    """`text` from `at` cut into pieces, in order and covering it, and the cursor to read
    it from once it has grown. An object where a call can be is a call only when it is
    whole, is valid JSON, names a function of `plan` with an object of arguments (in a
    forced named call the object is the arguments), and the plan allows one more call;
    any other is content. So an undeclared name, truncated or malformed arguments never
    reach `tool_calls`. Not `final`: the text may grow, and the pieces before the cursor
    stay as they are whatever comes (an `open` piece, undecided, is last). `final`: the
    text is whole, nothing is open (what is unfinished is content)."""
    syntax = _SYNTAX[plan.format]
    read = _arguments_of(plan.named or "") if plan.format == _NAMED else _call_of(plan)
    pieces: list[Piece] = []
    cur = at
    while True:
        if cur.state == _TAIL:
            _add(pieces, cur.pos, len(text), _CONTENT)
            return pieces, replace(cur, pos=len(text))
        if cur.state == _TOP:
            start, body = _opening(text, cur.pos, syntax, final)
            _add(pieces, cur.pos, start, _CONTENT)
            if body is None:
                cur = replace(cur, pos=start, state=_TAIL)
            elif body == _PARTIAL:
                return _open(pieces, text, replace(cur, pos=start))
            else:
                _add(pieces, start, body, _DROP)
                cur = Cursor(body, _OBJECT, cur.num_calls, (body, 0, False))
        elif cur.state == _OBJECT:
            end, scan = _object_end(text, cur.scan)
            if end is None and not final:
                return _open(pieces, text, replace(cur, scan=scan))
            if end is None:
                _add(pieces, cur.pos, len(text), _CONTENT)
                return pieces, cur
            call = read(text[cur.pos : end])
            if not plan.parallel and cur.num_calls:
                call = None
            pieces.append(Piece(cur.pos, end, _CONTENT if call is None else _CALL, call))
            cur = Cursor(end, _AFTER, cur.num_calls + (call is not None))
        else:
            nxt = None if syntax.between is None else _lead(text, cur.pos, (syntax.between,), final)
            close = _frame(text, cur.pos, syntax.close, final) if nxt is None else None
            if nxt == _PARTIAL or close == _PARTIAL:
                return _open(pieces, text, cur)
            if nxt is not None:
                _add(pieces, cur.pos, nxt, _DROP)
                cur = Cursor(nxt, _OBJECT, cur.num_calls, (nxt, 0, False))
                continue
            end = cur.pos if close is None else close
            _add(pieces, cur.pos, end, _DROP)
            if end == len(text) and not final:
                return pieces, cur  # more whitespace may come, or a frame
            cur = Cursor(end, _TOP if syntax.anywhere else _TAIL, cur.num_calls)


def _add(pieces: list[Piece], start: int, end: int, kind: str, call: Call | None = None) -> None:
    if end > start:
        pieces.append(Piece(start, end, kind, call))


def _open(pieces: list[Piece], text: str, cur: Cursor) -> tuple[list[Piece], Cursor]:
    _add(pieces, cur.pos, len(text), _OPEN)
    return pieces, cur


def _opening(text: str, pos: int, syntax: _Syntax, final: bool) -> tuple[int, int | None]:
    """Where calls open at or after `pos`: (start of their frame, start of their first
    object); (start, _PARTIAL): content before `start`, undecided from there; (pos, None):
    content from `pos` on, whatever comes (a format whose calls come first only)."""
    if not syntax.anywhere:
        return pos, _lead(text, pos, syntax.opens, final)
    marker = syntax.opens[0][0]
    at = pos
    while (at := text.find(marker, at)) >= 0:
        body = _lead(text, at, syntax.opens, final)
        if body is not None:
            return at, body
        at += 1
    held = 0 if final else _held_prefix(text, marker)
    return max(pos, len(text) - held), _PARTIAL


def _lead(text: str, pos: int, frames: tuple[tuple[str, ...], ...], final: bool) -> int | None:
    """Where the object after the first of `frames` at `pos` starts; None when no frame
    followed by an object is there, _PARTIAL when the text ends before that is known."""
    undecided = False
    for tokens in frames:
        end = _frame(text, pos, tokens, final)
        if end == _PARTIAL or end == len(text):
            undecided = not final
        elif end is not None and text[end] == "{":
            return end
    return _PARTIAL if undecided else None


def _frame(text: str, pos: int, tokens: tuple[str, ...], final: bool) -> int | None:
    """End of `tokens` at `pos`, whitespace around them included; None when they are not
    there, _PARTIAL (never when `final`) when the text ends inside them."""
    pos = _skip(text, pos)
    for token in tokens:
        if text.startswith(token, pos):
            pos = _skip(text, pos + len(token))
        elif not final and len(text) - pos < len(token) and token.startswith(text[pos:]):
            return _PARTIAL
        else:
            return None
    return pos


def _skip(text: str, pos: int) -> int:
    """`pos` past the whitespace there."""
    space = _WS.match(text, pos)
    return pos if space is None else space.end()


def _object_end(text: str, scan: tuple[int, int, bool]) -> tuple[int | None, tuple[int, int, bool]]:
    """Index just past a JSON object whose brackets have been counted as `scan` says
    (scanned to, depth, inside a string; (start, 0, False) at its `{`), None while it is
    open, and how far the count got. Each character is looked at once however the text
    grows."""
    pos, depth, in_string = scan
    while True:
        if in_string:
            pos = _skip_string(text, pos)
            if pos == len(text) or text[pos] != '"':  # the end, or a backslash at the end
                return None, (pos, depth, True)
            pos += 1
        found = _STRUCTURE.search(text, pos)
        if found is None:
            return None, (len(text), depth, False)
        pos, token = found.end(), found.group()
        in_string = token == '"'
        if not in_string:
            depth += 1 if token in "{[" else -1
            if depth == 0:
                return pos, (pos, 0, False)


def _skip_string(text: str, pos: int) -> int:
    """`pos` past a string's characters and escapes, at its end quote."""
    rest = _STRING_REST.match(text, pos)
    return pos if rest is None else rest.end()


def _json(text: str) -> Any:
    """`text` parsed as strict JSON (no NaN or Infinity), None when it is not JSON."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return None


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _call_of(plan: ToolPlan) -> Reader:
    names = {t["function"]["name"] for t in plan.tools}

    def read(obj: str) -> Call | None:
        """`{"name": …, "arguments": {…}}` (or `parameters`) of a declared function."""
        value = _json(obj)
        if not isinstance(value, dict) or len(value) != 2:
            return None
        name = value.get("name")
        args = value["arguments"] if "arguments" in value else value.get("parameters")
        if not isinstance(name, str) or name not in names or not isinstance(args, dict):
            return None
        head = _HEAD.match(obj)  # arguments after the name: kept as generated
        raw = obj[head.end() : obj.rindex("}")].rstrip() if head else ""
        if raw.startswith("{") and _object_end(raw, (0, 0, False))[0] == len(raw):
            return Call(name, raw)
        return Call(name, json.dumps(args, ensure_ascii=False))

    return read


def _arguments_of(name: str) -> Reader:
    def read(obj: str) -> Call | None:
        """A forced call's arguments: any JSON object."""
        return Call(name, obj) if isinstance(_json(obj), dict) else None

    return read


def _held_prefix(text: str, marker: str) -> int:
    """Characters at the end of `text` that could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def parse_calls(text: str, plan: ToolPlan) -> tuple[str, list[Call]]:
    """(content, calls) of a whole output."""
    pieces, _ = read_pieces(text, plan, final=True)
    content = "".join(text[p.start : p.end] for p in pieces if p.kind == _CONTENT)
    return content, [p.call for p in pieces if p.call is not None]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolStream:
    """One choice's tool-call reader: full text in, OpenAI deltas out. A call is sent once
    it is whole, in one delta carrying its id, name and all its arguments, so a stream
    never shows a call the whole answer would not have (undeclared, cut short by
    `max_tokens`, malformed); text is sent once it is certain to be content, and what is
    still undecided at the end (a call cut short) is sent as content by `flush`. The
    content and calls streamed are those of the whole answer, piece for piece."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # the text before this has been sent (as content or calls) or dropped
    ids: list[str] = field(default_factory=list)  # of the calls sent
    cursor: Cursor = field(default_factory=Cursor)  # what is read for good: not read again

    def push(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and `tool_calls` deltas that `delta` makes certain."""
        self.text += delta
        return self._send(final=False)

    def flush(self) -> str:
        """What is left, as content, once the text is known to be whole."""
        content, calls = self._send(final=True)
        assert not calls  # a call is certain, and sent, as soon as it is whole
        return content

    def _send(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        pieces, self.cursor = read_pieces(self.text, self.plan, final, self.cursor)
        content, calls = [], []
        for p in pieces:
            if p.kind == _OPEN:
                break
            if p.end <= self.sent:
                continue
            if p.kind == _CONTENT:
                content.append(self.text[max(p.start, self.sent) : p.end])
            elif p.call is not None:
                self.ids.append(new_call_id())
                calls.append({"index": len(self.ids) - 1, **_call_dict(p.call, self.ids[-1])})
            self.sent = p.end
        return "".join(content), calls

    def calls(self) -> list[dict[str, Any]]:
        """The final `message.tool_calls` (empty when the text holds none)."""
        _, calls = parse_calls(self.text, self.plan)
        while len(self.ids) < len(calls):
            self.ids.append(new_call_id())
        return [_call_dict(c, self.ids[i]) for i, c in enumerate(calls)]

    def content(self) -> str | None:
        """The final `message.content`: None when there are calls and no text beside them."""
        content, calls = parse_calls(self.text, self.plan)
        return content or (None if calls else "")


def _call_dict(call: Call, call_id: str) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call_id, "type": "function", "function": function}
