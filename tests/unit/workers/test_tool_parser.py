"""What counts as a tool call, per call format: only a whole, valid call of a declared
function, within `parallel_tool_calls`. A call naming a function the request did not
declare, a call cut short (max_tokens) and a call whose arguments are not a JSON object
are content, in the whole answer and in the streamed one, where no delta ever carries
them; the streamed answer has the whole one's content and calls."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.outputs import RequestOutput
from workers.engine.request import FinishReason
from workers.server.logprobs import TokenTexts
from workers.server.openai_format import ResponseBuilder
from workers.server.tools import ToolPlan, ToolStream, read_pieces

DECLARED = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
NAMES = {"get_weather", "get_time"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {}}'
ROGUE = '{"name": "delete_files", "arguments": {"path": "/"}}'
CUT = '{"name": "get_weather", "arguments": {"city": "Pa'
NOT_JSON = '{"name": "get_weather", "arguments": {"city": Paris}}'
NAN = '{"name": "get_weather", "arguments": {"days": NaN}}'
STRING_ARGS = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
LIST_ARGS = '{"name": "get_weather", "arguments": ["Paris"]}'
LIST_NAME = '{"name": ["get_weather"], "arguments": {}}'


def _frame(fmt: str, *calls: str) -> str:
    """`calls` as the format writes them."""
    if fmt == "qwen":
        return "Checking.\n" + "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
    if fmt == "llama":
        return "<|python_tag|>" + "; ".join(calls)
    if fmt == "mistral":
        return "[TOOL_CALLS][" + ", ".join(calls) + "]"
    return "[" + ", ".join(calls) + "]"


FORMATS = ["qwen", "llama", "mistral", "required"]


def _plan(fmt: str, parallel: bool = True) -> ToolPlan:
    if fmt == "named":
        return ToolPlan("named", DECLARED, "get_weather", parallel=False)
    return ToolPlan(fmt, DECLARED, parallel=parallel)


def _whole(plan: ToolPlan, text: str) -> tuple[str, list[tuple[str, str]]]:
    """The final message's content and (name, arguments) calls, as a whole answer has them."""
    stream = ToolStream(plan)
    stream.text = text
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in stream.calls()]
    return stream.content() or "", calls


def _streamed(plan: ToolPlan, deltas: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    """Content, calls and the raw `tool_calls` deltas of a stream of `deltas`."""
    stream = ToolStream(plan)
    content, sent = "", []
    for delta in deltas:
        c, calls = stream.push(delta)
        content += c
        sent += calls
    content += stream.flush()
    assert [d["index"] for d in sent] == list(range(len(sent)))
    return content, [(d["function"]["name"], d["function"]["arguments"]) for d in sent], sent


def _both(plan: ToolPlan, text: str) -> tuple[str, list[tuple[str, str]]]:
    """The whole answer, checked equal to the stream of one character per step."""
    whole = _whole(plan, text)
    content, calls, _ = _streamed(plan, list(text))
    assert (content, calls) == whole
    return whole


def _args(calls: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    return [(name, json.loads(args)) for name, args in calls]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_call_to_an_undeclared_function_is_content_not_a_call(fmt):
    content, calls = _both(_plan(fmt), _frame(fmt, WEATHER, ROGUE))
    assert _args(calls) == [("get_weather", {"city": "Paris"})]
    assert ROGUE in content
    _, _, deltas = _streamed(_plan(fmt), list(_frame(fmt, WEATHER, ROGUE)))
    assert all("delete_files" not in json.dumps(d) for d in deltas)


@pytest.mark.parametrize("fmt", FORMATS)
def test_parallel_calls_keep_the_declared_ones_around_an_undeclared_one(fmt):
    content, calls = _both(_plan(fmt), _frame(fmt, ROGUE, WEATHER, TIME))
    assert _args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert ROGUE in content


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_call_cut_short_is_content_not_a_call_with_truncated_arguments(fmt):
    text = _frame(fmt, WEATHER, CUT)
    text = text[: text.rindex(CUT) + len(CUT)]  # max_tokens ends it in the arguments
    content, calls = _both(_plan(fmt), text)
    assert _args(calls) == [("get_weather", {"city": "Paris"})]
    assert content.endswith(CUT)


@pytest.mark.parametrize("fmt", FORMATS)
def test_text_after_the_calls_is_content_without_the_frames(fmt):
    content, calls = _both(_plan(fmt), _frame(fmt, WEATHER) + "\n Done.")
    assert _args(calls) == [("get_weather", {"city": "Paris"})]
    assert content == ("Checking.\nDone." if fmt == "qwen" else "Done.")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [NOT_JSON, NAN, STRING_ARGS, LIST_ARGS, LIST_NAME])
def test_a_call_whose_arguments_are_not_a_json_object_is_content(fmt, bad):
    content, calls = _both(_plan(fmt), _frame(fmt, bad))
    assert calls == [] and bad in content


@pytest.mark.parametrize("fmt", FORMATS)
def test_with_parallel_tool_calls_false_a_second_call_is_content(fmt):
    content, calls = _both(_plan(fmt, parallel=False), _frame(fmt, WEATHER, TIME))
    assert _args(calls) == [("get_weather", {"city": "Paris"})]
    assert TIME in content


def test_a_forced_named_call_is_its_whole_object_else_content():
    plan = _plan("named")
    assert _both(plan, '{"city": "Paris"}\n') == ("", [("get_weather", '{"city": "Paris"}')])
    for bad in ('{"city": "Pa', '{"city": Paris}', '{"days": NaN}', '["Paris"]', ""):
        assert _both(plan, bad) == (bad, [])


def test_a_streamed_call_is_sent_whole_once_it_is_whole():
    """Its first delta carries the id, the name and all the arguments; nothing of it before."""
    stream = ToolStream(_plan("qwen"))
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    cut = text.index(WEATHER) + len(WEATHER)
    for ch in text[: cut - 1]:
        assert stream.push(ch) == ("", [])
    content, deltas = stream.push(text[cut - 1])
    assert content == ""
    ((delta,),) = [deltas]
    assert delta["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert delta["id"].startswith("call_") and delta["index"] == 0


# Fragments an output of any format may be made of, markers and calls good and bad.
FRAGMENTS = [
    WEATHER, TIME, ROGUE, CUT, NOT_JSON, NAN, STRING_ARGS, '{"answer": 42}', '{"city": "Paris"}',
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<tool", "[TOOL",
    "[", "]", ",", ";", "{", "}", '"', "\\", " ", "\n", "Hello", "x",
]  # fmt: skip


CALLS = [WEATHER, TIME, ROGUE, CUT, NOT_JSON, NAN, '{"answer": 42}', '{"city": "Paris"}']


@st.composite
def outputs(draw: st.DrawFn) -> tuple[str, str]:
    """(format, text): fragments and calls framed in any format, one after another."""
    fmt = draw(st.sampled_from([*FORMATS, "named"]))
    framed = st.builds(
        lambda f, calls: _frame(f, *calls),
        st.sampled_from(FORMATS),
        st.lists(st.sampled_from(CALLS), min_size=1, max_size=3),
    )
    parts = draw(st.lists(st.one_of(st.sampled_from(FRAGMENTS), framed), max_size=5))
    return fmt, "".join(parts)


@settings(max_examples=400, deadline=None)
@given(output=outputs(), parallel=st.booleans(), cuts=st.lists(st.integers(0, 600), max_size=6))
def test_any_output_streamed_in_any_pieces_has_the_whole_answers_calls_all_valid(
    output, parallel, cuts
):
    """Whatever the text and however it is split: the pieces cover it in order, none left
    open; the stream has the whole answer's content and calls; every call names a declared
    function with a JSON object of arguments; and a call once sent stays one (every prefix
    of the text, an answer cut there, has a prefix of the calls)."""
    fmt, text = output
    plan = _plan(fmt, parallel)
    pieces, _ = read_pieces(text, plan, final=True)
    ends = [0] + [p.end for p in pieces]
    assert [p.start for p in pieces] == ends[:-1] and ends[-1] == len(text)
    assert all(p.kind != "open" for p in pieces)  # a whole text leaves nothing undecided
    content, calls = _whole(plan, text)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert _streamed(plan, deltas)[:2] == (content, calls)
    assert _streamed(plan, list(text))[:2] == (content, calls)
    for name, args in calls:
        assert name in NAMES
        assert isinstance(json.loads(args, parse_constant=_not_json), dict)
    assert parallel or len(calls) <= 1
    for end in range(len(text)):
        cut_calls = _whole(plan, text[:end])[1]
        assert calls[: len(cut_calls)] == cut_calls


def _not_json(constant: str) -> None:
    raise ValueError(constant)


def _out(text: str, finished: bool, reason: FinishReason | None) -> RequestOutput:
    return RequestOutput("r", [1], text, finished, reason, None, 3, 1, 0)


@pytest.mark.parametrize(
    "text, reason, finish, content, names",
    [
        (_frame("qwen", WEATHER), FinishReason.STOP, "tool_calls", "Checking.\n", ["get_weather"]),
        (_frame("qwen", ROGUE), FinishReason.STOP, "stop", f"Checking.\n{ROGUE}", []),
        (f"<tool_call>\n{CUT}", FinishReason.LENGTH, "length", CUT, []),
    ],
)
def test_the_response_streamed_or_whole_has_the_same_calls_and_finish_reason(
    text, reason, finish, content, names
):
    """An undeclared call ends a response with `stop`, not `tool_calls`; one cut short by
    max_tokens with `length`, its text as content; streamed and whole alike."""
    whole = ResponseBuilder("r", "m", True, TokenTexts(None), tools=_plan("qwen"))
    choice = whole.choice(0, text, _out(text, True, reason), None)
    assert choice["finish_reason"] == finish
    assert choice["message"]["content"] == (content or None)
    assert [c["function"]["name"] for c in choice["message"].get("tool_calls", [])] == names
    stream = ResponseBuilder("r", "m", True, TokenTexts(None), tools=_plan("qwen"))
    chunks = [
        stream.chunk(ch, _out(ch, i == len(text) - 1, reason), i == 0)["choices"][0]
        for i, ch in enumerate(text)
    ]
    assert "".join(c["delta"].get("content", "") for c in chunks) == content
    calls = [d for c in chunks for d in c["delta"].get("tool_calls", [])]
    assert [d["function"]["name"] for d in calls] == names
    assert [c["finish_reason"] for c in chunks] == [None] * (len(text) - 1) + [finish]
