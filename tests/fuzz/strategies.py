"""Hypothesis strategies for hostile requests to `/v1/completions` and `/v1/chat/completions`.

Most bodies are *almost valid*: a valid skeleton (max_tokens 1..8, so the tiny worker
answers fast) with one to three fields set to a hostile value. The rest are whole-body
faults (invalid JSON bytes, empty, not an object, nested thousands deep, up to ~2 MB).
Headers vary `x-request-timeout`, `authorization` and `content-type`.

Values JSON cannot carry (NaN, 1e309, nesting deeper than `json.dumps` recurses, invalid
UTF-8) are spliced into the encoded body as raw text (`Raw`).
"""

import json
from dataclasses import dataclass, field

from hypothesis import strategies as st

KEY = "{key}"  # stands for the tenant's API key in an authorization header value
HUGE_BYTES = 2_000_000  # the largest body generated (sparingly)


@dataclass(frozen=True)
class Raw:
    """JSON text put into the encoded body as is."""

    text: str


@dataclass(frozen=True)
class Case:
    """One generated request."""

    path: str
    content: bytes
    headers: tuple[tuple[str, str], ...]  # values may contain KEY
    body: object = None  # the JSON value before encoding; None for whole-body faults
    labels: tuple[str, ...] = field(default=())  # what was mutated

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True

    @property
    def wants_usage(self) -> bool:
        opts = self.body.get("stream_options") if isinstance(self.body, dict) else None
        return self.stream and isinstance(opts, dict) and opts.get("include_usage") is True

    @property
    def countable(self) -> bool:
        """The client learns what it is charged: a decoded body that is not a stream
        without the usage chunk."""
        return isinstance(self.body, dict) and (not self.stream or self.wants_usage)

    def describe(self, limit: int = 500) -> str:
        """A reproducer: method, path, headers, body (cut to `limit` bytes, length noted)."""
        body = self.content if len(self.content) <= limit else self.content[:limit] + b"..."
        return (
            f"POST {self.path} headers={dict(self.headers)} "
            f"body({len(self.content)} bytes)={body!r} mutations={list(self.labels)}"
        )


def encode(value: object) -> bytes:
    """JSON bytes of `value`, with every `Raw` spliced in verbatim."""
    raws: list[str] = []

    def default(obj: object) -> str:
        if isinstance(obj, Raw):
            raws.append(obj.text)
            return f"\x00raw{len(raws) - 1}\x00"
        raise TypeError(type(obj))

    text = json.dumps(value, default=default)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw, 1)
    return text.encode("utf-8", "surrogatepass")


# -- values ---------------------------------------------------------------------------------

LONE_SURROGATES = ["\ud800", "\udfff", "a\ud83d", "\udc00\ud800"]
words = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=24)
garbage_text = st.one_of(
    st.text(max_size=40),  # any unicode (no surrogates): controls, RTL, emoji, NUL
    st.sampled_from(LONE_SURROGATES + ["\x00", "\u202e\u0000\ufeff", "🦜" * 50, "\r\n\t"]),
)


def pick(values: list) -> st.SearchStrategy:
    """One of `values`, uniformly. Hypothesis leans its choices towards the first of a
    `sampled_from`; the mix of mutations should not."""
    return st.randoms(use_true_random=True).map(lambda rnd: rnd.choice(values))


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in `n` draws."""
    return pick([False] * (n - 1) + [True])


finite = st.floats(allow_nan=False, allow_infinity=False)
EDGE_INTS = [
    -1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
    2**100, 10**400, -(2**31) - 1, -(2**63), -(2**63) - 1, -(2**64), -(10**400),
]  # fmt: skip
edge_ints = st.sampled_from(EDGE_INTS)
any_int = st.one_of(edge_ints, st.integers(), st.integers(-(2**200), 2**200))
NAN_STRINGS = ["NaN", "nan", "Infinity", "-Infinity", "inf", "1e309", "", " 1 ", "0x10", "1_0"]
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e309", "-1e309", "1e-400", "-0.0", "1" * 400]
non_finite = st.sampled_from(NON_FINITE).map(Raw)
json_scalar = st.one_of(st.none(), st.booleans(), any_int, finite, st.text(max_size=12))
json_value = st.recursive(
    json_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(words, inner, max_size=3),
    max_leaves=8,
)
wrong_type = st.one_of(
    st.none(), st.booleans(), words, finite, any_int, st.lists(st.integers(), max_size=3),
    st.dictionaries(words, st.integers(), max_size=2), non_finite,
)  # fmt: skip


@st.composite
def deep_json(draw: st.DrawFn) -> Raw:
    """Arrays and objects nested 10..5000 deep (balanced or not)."""
    depth = draw(st.one_of(st.sampled_from([31, 32, 33, 64]), st.integers(10, 5000)))
    style = draw(st.sampled_from(["array", "object", "mixed", "unclosed"]))
    if style == "array":
        return Raw("[" * depth + "]" * depth)
    if style == "object":
        return Raw('{"a":' * depth + "1" + "}" * depth)
    if style == "mixed":
        return Raw('[{"a":' * (depth // 2) + "null" + "}]" * (depth // 2))
    return Raw("[" * depth)


def _floats_hostile() -> st.SearchStrategy:
    edges = [-1e-9, -0.0, 0.0, 1.0, 1.0000001, 2.0, 2.0000001, 3.0, 1e308, -1e308, 5e-324]
    return st.one_of(
        st.sampled_from(edges), finite, st.sampled_from(NAN_STRINGS), non_finite, edge_ints
    )


# -- skeletons ------------------------------------------------------------------------------


def _options(vocab: int) -> dict:
    return {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "seed": st.integers(0, 2**32),
        "top_k": st.integers(0, 50),
        "min_p": st.floats(0, 0.5),
        "stop": st.lists(words, max_size=2),
        "user": words,
        "stop_token_ids": st.lists(st.integers(0, vocab - 1), max_size=3),
    }


@st.composite
def valid_completion(draw: st.DrawFn, vocab: int, models: tuple[str, ...]) -> dict:
    body = {"model": draw(st.sampled_from(models)), "max_tokens": draw(st.integers(1, 8))}
    body["prompt"] = draw(
        st.one_of(
            words,
            st.lists(st.integers(3, vocab - 1), min_size=1, max_size=16),
            words.map(lambda s: [s]),
        )
    )
    body.update(draw(st.fixed_dictionaries({}, optional=_options(vocab))))
    body.update(draw(st.fixed_dictionaries({}, optional={"logprobs": st.integers(0, 3)})))
    return _streamed(draw, body)


@st.composite
def valid_chat(draw: st.DrawFn, vocab: int, models: tuple[str, ...]) -> dict:
    roles = st.sampled_from(["system", "user", "assistant", "developer"])
    content = st.one_of(words, st.just([{"type": "text", "text": "hello"}]))
    history = st.lists(st.fixed_dictionaries({"role": roles, "content": content}), max_size=3)
    messages = draw(history) + [{"role": "user", "content": draw(content)}]
    body = {"model": draw(st.sampled_from(models)), "messages": messages}
    body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = draw(st.integers(1, 8))
    body.update(draw(st.fixed_dictionaries({}, optional=_options(vocab))))
    if draw(st.booleans()):
        body["logprobs"] = True
        body.update(draw(st.fixed_dictionaries({}, optional={"top_logprobs": st.integers(0, 3)})))
    return _streamed(draw, body)


def _streamed(draw: st.DrawFn, body: dict) -> dict:
    if draw(pick([False, True])):
        body["stream"] = True
        if not draw(one_in(4)):  # three in four streams ask for the usage chunk
            body["stream_options"] = {"include_usage": True}
    return body


# -- mutations: each sets one field of `body` to something hostile ----------------------------

SAMPLING_FIELDS = (
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "seed", "presence_penalty", "frequency_penalty", "user", "priority", "cache_salt",
    "ignore_eos", "min_tokens", "top_k", "min_p", "stop_token_ids",
)  # fmt: skip
COMPLETION_FIELDS = (*SAMPLING_FIELDS, "prompt", "logprobs", "echo")
CHAT_FIELDS = (*SAMPLING_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs")


def _fields(body: dict) -> tuple[str, ...]:
    return CHAT_FIELDS if "messages" in body else COMPLETION_FIELDS


def _history(body: dict) -> list:
    """The messages before the last, whatever an earlier mutation made of the list."""
    messages = body.get("messages")
    return messages[:-1] if isinstance(messages, list) else []


@st.composite
def m_seed(draw, body, vocab):
    body["seed"] = draw(st.one_of(edge_ints, st.integers(-(2**200), 2**200), st.just(1.5)))


@st.composite
def m_top_k(draw, body, vocab):
    edges = [-2, -1, 0, 1, vocab - 1, vocab, vocab + 1, 2**31 - 1, 2**31, 2**63, 10**30]
    body["top_k"] = draw(st.one_of(st.sampled_from(edges), any_int))


@st.composite
def m_float_field(draw, body, vocab):
    name = draw(st.sampled_from(["temperature", "top_p", "min_p", "presence_penalty",
                                 "frequency_penalty"]))  # fmt: skip
    body[name] = draw(_floats_hostile())


@st.composite
def m_stop(draw, body, vocab):
    body["stop"] = draw(
        st.one_of(
            st.lists(words, min_size=5, max_size=60),
            st.sampled_from([["x" * 257], ["y" * 10_000], "z" * 300, ["s" * 256] * 4]),
            st.sampled_from([[""], "", [], [None], [1], 5, {"a": 1}, [["a"]], True]),
            st.sampled_from([["\ufffd"], [" "], ["e"], ["\n"], "\x00", [".", ",", " ", "e"]]),
            st.lists(garbage_text, min_size=1, max_size=4),
        )
    )


@st.composite
def m_stop_token_ids(draw, body, vocab):
    edges = [vocab - 1, vocab, vocab + 1, -1, 2**31, 2**63, 2**64]
    body["stop_token_ids"] = draw(
        st.one_of(
            st.lists(st.sampled_from(edges), min_size=1, max_size=4),
            st.lists(st.integers(0, vocab - 1), min_size=257, max_size=300),
            st.just(list(range(256))),  # nearly every token stops at once
            st.sampled_from([[1.5], ["1"], [True], [None], 7, "1,2"]),
        )
    )


@st.composite
def m_prompt(draw, body, vocab):
    if "messages" in body:
        return draw(m_messages(body, vocab))
    body["prompt"] = draw(
        st.one_of(
            st.lists(st.sampled_from([vocab, vocab + 1, -1, 2**31, 2**64]), min_size=1, max_size=3),
            st.sampled_from(["", [], ["a", "b"], [1, "a"], [[1, 2]], [None], [True, False], [""]]),
            st.integers(2040, 2100).map(lambda n: [5] * n),  # at or past the context
            st.integers(5_000, 60_000).map(lambda n: "word " * (n // 5)),
            garbage_text,
            st.lists(garbage_text, min_size=1, max_size=1),
        )
    )


@st.composite
def m_max_tokens(draw, body, vocab):
    name = "max_tokens"
    if "messages" in body:
        name = draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))
    hostile = [
        0,
        -1,
        300,
        1000,
        2047,
        2048,
        2049,
        4096,
        4097,
        10**6,
        2**31,
        2**63,
        2**64,
        10**30,
        -(2**63),
    ]
    body[name] = draw(
        st.one_of(st.sampled_from(hostile), st.sampled_from([1.5, "8", True, 8.0]), any_int)
    )


@st.composite
def m_min_tokens(draw, body, vocab):
    top = body.get("max_tokens") if isinstance(body.get("max_tokens"), int) else 8
    body["min_tokens"] = draw(st.sampled_from([-1, top, top + 1, 10**6, 2**63, 2**64, "2", 1.0]))
    if draw(st.booleans()):
        body["ignore_eos"] = True


@st.composite
def m_n(draw, body, vocab):
    body["n"] = draw(st.sampled_from([0, 2, -1, 128, 2**31, 2**64, 1.0, "1", True, None]))


@st.composite
def m_logprobs(draw, body, vocab):
    if "messages" in body:
        body["logprobs"] = draw(st.sampled_from([True, False, "true", 1, None]))
        body["top_logprobs"] = draw(st.sampled_from([-1, 0, 20, 21, 2**31, 2**63, 2**64, None]))
    else:
        body["logprobs"] = draw(st.sampled_from([-1, 0, 20, 21, 2**31, 2**64, True, 1.5, "5"]))
        body["echo"] = draw(st.sampled_from([True, False, "yes"]))


@st.composite
def m_messages(draw, body, vocab):
    if "messages" not in body:
        return draw(m_prompt(body, vocab))
    msg = {"role": "user", "content": "hi"}
    kind = draw(st.integers(0, 4))
    if kind == 0:  # bad or huge role / name
        msg["role"] = draw(st.sampled_from(["root", "", "USER", "system\x00", 5, None, "function",
                                            "u" * 100_000]))  # fmt: skip
        if draw(st.booleans()):
            msg["name"] = draw(st.sampled_from(["n" * 100_000, 5, "", "\ud800"]))
    elif kind == 1:  # content parts of the wrong type
        msg["role"] = draw(st.sampled_from(["user", "assistant", "system", "tool", "developer"]))
        msg["content"] = draw(
            st.sampled_from(
                [
                    [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    [{"type": "text"}], [{"type": "text", "text": 5}], [1], ["text"], [None],
                    {"type": "text", "text": "hi"}, 5, [], None, True,
                    [{"type": "text", "text": "a"}] * 257, [{"text": "no type"}],
                ]
            )
        )  # fmt: skip
    elif kind == 2:  # the list itself
        body["messages"] = draw(
            st.sampled_from([[], {}, "hi", [None], [[]], [{}], [{"content": "hi"}], None])
        )
        return
    elif kind == 3:
        msg["content"] = draw(garbage_text)
    else:  # unknown keys on a message, or a message of another shape
        msg.update(draw(st.dictionaries(words, json_value, min_size=1, max_size=3)))
    body["messages"] = [*_history(body), msg]


@st.composite
def m_sampling_extremes(draw, body, vocab):
    """Values inside the bounds that push the sampler to its edges."""
    extremes = {
        "temperature": st.sampled_from([5e-324, 1e-300, 1e-8, 2.0, 0.0]),
        "top_p": st.sampled_from([5e-324, 1e-300, 1e-8, 1.0]),
        "min_p": st.sampled_from([1.0, 0.999999, 5e-324]),
        "top_k": st.sampled_from([1, 2, vocab, -1]),
        "seed": st.sampled_from([0, 2**64 - 1, -(2**63), 2**63]),
        "ignore_eos": st.just(True),
        "min_tokens": st.integers(0, 8),
        "logprobs": st.sampled_from([0, 20]),
    }
    picked = draw(st.fixed_dictionaries({}, optional=extremes))
    if "messages" in body:
        picked.pop("logprobs", None)
    top = body.get("max_tokens")
    top = top if type(top) is int and top > 0 else 1
    picked["min_tokens"] = min(picked.get("min_tokens", 0), top)
    body.update(picked)


@st.composite
def m_operator(draw, body, vocab):
    name = draw(st.sampled_from(["priority", "cache_salt", "ignore_eos"]))
    values = {
        "priority": [2**31, -(2**31) - 1, 2**31 - 1, 2**63, 10**30, -(10**30), "high", 1.5, -1],
        "cache_salt": ["", "s" * 257, "s" * 100_000, 5, None, "\ud800", "\x00"],
        "ignore_eos": [True, "yes", 1, None],
    }
    body[name] = draw(st.sampled_from(values[name]))


@st.composite
def m_stream(draw, body, vocab):
    body["stream"] = draw(st.sampled_from([True, False, "true", 1, None]))
    body["stream_options"] = draw(
        st.sampled_from(
            [
                {"include_usage": "yes"}, 5, [], {"include_usage": True, "extra": 1},
                {"continuous_usage_stats": True}, None, {"include_usage": None},
                {"include_usage": True},
            ]
        )
    )  # fmt: skip


@st.composite
def m_model(draw, body, vocab):
    values = ["nope", "", "SMALL", 5, None, "x" * 10_000, "small\x00", "auto", "../small"]
    body["model"] = draw(st.sampled_from([*values, "\ud800", ["small"]]))


@st.composite
def m_wrong_type(draw, body, vocab):
    body[draw(st.sampled_from(_fields(body)))] = draw(wrong_type)


@st.composite
def m_delete(draw, body, vocab):
    body.pop(draw(st.sampled_from(_fields(body))), None)


@st.composite
def m_unknown(draw, body, vocab):
    extra = draw(st.dictionaries(words, json_value, min_size=1, max_size=4))
    if draw(st.booleans()):  # the gateway's own field, out of range
        values = [-1, 2, 1.5, "0.5", True, Raw("NaN"), None, 0.5]
        extra["switchyard_threshold"] = draw(st.sampled_from(values))
    body.update(extra)


@st.composite
def m_deep(draw, body, vocab):
    name = draw(st.one_of(st.sampled_from(_fields(body)), words))
    body[name] = draw(deep_json())


@st.composite
def m_unicode(draw, body, vocab):
    name = draw(st.sampled_from(["user", "stop", "model", "prompt", "cache_salt"]))
    if name == "prompt" and "messages" in body:
        body["messages"] = [*_history(body), {"role": "user", "content": draw(garbage_text)}]
    else:
        body[name] = draw(garbage_text)


@st.composite
def m_huge(draw, body, vocab):
    """Bodies of about 1..2 MB: drawn rarely."""
    size = draw(st.integers(1_000_000, HUGE_BYTES - 10_000))
    kind = draw(st.sampled_from(["text", "ids", "stop", "number", "messages"]))
    if kind == "text":
        if "messages" in body:
            body["messages"] = [{"role": "user", "content": "y" * size}]
        else:
            body["prompt"] = "x" * size
    elif kind == "ids":
        body["prompt" if "prompt" in body else "stop_token_ids"] = [7] * (size // 3)
    elif kind == "stop":
        body["stop"] = ["st"] * (size // 6)
    elif kind == "number":
        body[draw(st.sampled_from(["seed", "max_tokens", "top_k"]))] = Raw("9" * size)
    else:
        body["messages"] = [{"role": "user", "content": "m"}] * (size // 40)


MUTATIONS = (
    m_seed, m_top_k, m_float_field, m_stop, m_stop_token_ids, m_prompt, m_max_tokens,
    m_min_tokens, m_n, m_logprobs, m_messages, m_operator, m_stream, m_model, m_wrong_type,
    m_delete, m_unknown, m_deep, m_unicode, m_sampling_extremes,
)  # fmt: skip


# -- whole-body faults ----------------------------------------------------------------------


@st.composite
def whole_body_fault(draw: st.DrawFn, content: bytes) -> tuple[bytes, str]:
    kind = draw(
        pick(
            ["truncate", "insert", "flip", "utf8", "empty", "not_object", "bom", "trailing",
             "duplicate_key", "nul", "deep_top"]
        )
    )  # fmt: skip
    pos = draw(st.integers(0, max(len(content) - 1, 0)))
    if kind == "truncate":
        return content[:pos], kind
    if kind == "insert":
        return content[:pos] + draw(st.binary(min_size=1, max_size=8)) + content[pos:], kind
    if kind == "flip":
        byte = draw(st.integers(0, 255))
        return content[:pos] + bytes([byte]) + content[pos + 1 :], kind
    if kind == "utf8":  # invalid UTF-8 inside the first string value
        at = content.find(b'"', content.find(b":")) + 1
        return content[:at] + b"\xff\xfe\xc3(" + content[at:], kind
    if kind == "empty":
        return draw(st.sampled_from([b"", b" ", b"\n", b"\x00"])), kind
    if kind == "not_object":
        values = [b"[]", b"null", b"42", b'"str"', b"[{}]", b"true", b"{}", b"[" + content + b"]"]
        return draw(st.sampled_from(values)), kind
    if kind == "bom":
        return b"\xef\xbb\xbf" + content, kind
    if kind == "trailing":
        return content + draw(st.sampled_from([b"x", b"{}", content, b"\x00", b" , "])), kind
    if kind == "duplicate_key":  # the same key twice, the second hostile
        return b'{"model": 5, "max_tokens": -1, ' + content[1:], kind
    if kind == "nul":
        return content.replace(b":", b":\x00", 1), kind
    depth = draw(st.integers(1000, 100_000))
    return b"[" * depth + b"]" * depth, kind


# -- headers --------------------------------------------------------------------------------

TIMEOUTS = [
    "NaN", "nan", "inf", "-inf", "Infinity", "-1", "0", "-0", "1e309", "abc", "", "1e-9",
    "0.0001", "0.05", "0.2", "0.5", "86400", "86401", "1" * 400, "30", "1e3", "0x10", "+5",
    "5s", "5 s", "\xa0",
]  # fmt: skip
BAD_AUTH = [
    None, "Bearer", f"Bearer\t{KEY}", "Basic dXNlcjpwYXNz", "Bearer wrong", "Bearer sy-deadbeef-00",
    f"bearer {KEY}", f"BEARER {KEY}", f"Bearer   {KEY}", KEY, f"Bearer {KEY}x",
    "Bearer " + "k" * 10_000, f"Bearer {KEY} extra", "Bearer \xe9\xe8",
]  # fmt: skip
CONTENT_TYPES = [
    None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=zz",
    "application/json; charset=utf-16", "", "*/*", "application/json, text/plain",
]  # fmt: skip


@st.composite
def header_sets(draw: st.DrawFn) -> tuple[tuple[str, str], ...]:
    headers: dict[str, str | None] = {"content-type": "application/json"}
    headers["authorization"] = f"Bearer {KEY}"
    if draw(one_in(6)):
        headers["authorization"] = draw(st.sampled_from(BAD_AUTH))
    if draw(one_in(4)):
        headers["x-request-timeout"] = draw(st.sampled_from(TIMEOUTS))
    if draw(one_in(8)):
        headers["content-type"] = draw(st.sampled_from(CONTENT_TYPES))
    if draw(one_in(16)):
        headers["content-encoding"] = draw(st.sampled_from(["gzip", "br", "identity", "zz"]))
    return tuple((k, v) for k, v in headers.items() if v is not None)


# -- cases ----------------------------------------------------------------------------------


def plan(total: int) -> list[tuple[str, object, int]]:
    """How a run of `total` examples is split: (kind, first mutation, examples) per group,
    one Hypothesis run each, so every mutation gets its share even in a short slice
    (Hypothesis by itself favours variations of what it already drew). Per 40 cases about
    4 valid, 4 whole-body faults, 1 of about 2 MB, 31 mutated (every mutation alike)."""
    groups = [("valid", None, 4.0), ("fault", None, 4.0), ("mutated", m_huge, 1.0)]
    groups += [("mutated", m, 31.0 / len(MUTATIONS)) for m in MUTATIONS]
    return [(kind, first, max(1, round(total * w / 40))) for kind, first, w in groups]


@st.composite
def cases(
    draw: st.DrawFn,
    vocab: int,
    models: tuple[str, ...],
    kind: str = "mutated",
    first: object = None,
) -> Case:
    """A request of `kind` ("valid", "mutated", "fault"); a mutated one gets `first` (a
    mutation, or a drawn one when None) and up to two more drawn mutations."""
    chat = draw(pick([False, True]))
    body = draw(valid_chat(vocab, models) if chat else valid_completion(vocab, models))
    labels: list[str] = []
    if kind == "mutated":
        extra = draw(st.lists(st.sampled_from(MUTATIONS), max_size=2))
        for mutate in [first or draw(st.sampled_from(MUTATIONS)), *extra]:
            draw(mutate(body, vocab))
            labels.append(mutate.__name__)
    content = encode(body)
    value: object = body
    if kind == "fault":
        content, fault = draw(whole_body_fault(content))
        labels.append(f"body:{fault}")
        value = None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Case(path, content, draw(header_sets()), value, tuple(labels))
