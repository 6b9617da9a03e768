"""Cheap, deterministic request features for the difficulty classifier.

Everything here is pure Python (regexes and counting), so the gateway can score a
request without scikit-learn. Training wraps the same two functions, `dense_features`
and `text_tokens`, in a scikit-learn pipeline; inference in `cascade.artifact` calls
them directly, so train and serve cannot drift apart. Change any feature and bump
`FEATURE_VERSION`: an artifact built with another version is refused at load time.
"""

import math
import re
from dataclasses import dataclass

FEATURE_VERSION = "features-v1"

_WORD = re.compile(r"\w+")
_TOKEN = re.compile(r"\w+|[^\w\s]")  # a rough stand-in for BPE tokens: words and symbols
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_OPERATOR = re.compile(r"[+*/=^<>%|]|(?<=[\s\d])[-−](?=[\s\d])")
_MATH_SYMBOL = re.compile(r"[$\\∫∑√π≤≥≠×÷∞∈∀∃θλμσ]")
_LIST_MARKER = re.compile(r"^[ \t]*(?:[-*•]|\d{1,3}[.)]|[A-Za-z][.)])[ \t]", re.MULTILINE)
_CAPS_WORD = re.compile(r"\b[A-Z]{2,}\b")
_ROMAN_OPTION = re.compile(r"\b(?:I|II|III|IV)\b")

DENSE_FEATURE_NAMES: tuple[str, ...] = (
    "log_chars",
    "log_words",
    "log_whitespace_tokens",
    "log_approx_tokens",
    "log_lines",
    "log_last_user_chars",
    "log_turns",
    "log_system_chars",
    "log_code_fences",
    "log_numbers",
    "digit_frac",
    "log_operators",
    "log_math_symbols",
    "log_question_marks",
    "log_list_markers",
    "log_caps_words",
    "log_roman_numerals",
    "mean_word_len",
    "long_word_frac",
    "type_token_ratio",
    "upper_frac",
    "non_ascii_frac",
    "log_max_tokens",
    "has_max_tokens",
)


@dataclass(frozen=True, slots=True)
class RequestView:
    """The parts of a request the features look at.

    `text` is every message's content joined by newlines (or the bare prompt);
    `last_user` is the last user turn (the prompt itself for completions);
    `num_turns` counts non-system messages (1 for a bare prompt);
    `system_chars` is the total length of system messages; `max_tokens` is the
    requested completion budget, None when the client did not set one.
    """

    text: str
    last_user: str
    num_turns: int
    system_chars: int
    max_tokens: int | None


def _content_text(content: object) -> str:
    """A message's `content`: a string, or OpenAI content parts (text parts only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return ""


def request_view(
    prompt: str, messages: list[dict] | None = None, max_tokens: int | None = None
) -> RequestView:
    """Normalise a completion prompt or a chat message list into a `RequestView`.

    With `messages`, the prompt string is ignored (the gateway may pass the rendered
    chat or an empty string); without, `prompt` is one user turn.
    """
    if not messages:
        return RequestView(prompt, prompt, 1, 0, max_tokens)
    parts: list[str] = []
    system_chars = 0
    num_turns = 0
    last_user = ""
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        text = _content_text(msg.get("content"))
        parts.append(text)
        role = msg.get("role")
        if role in ("system", "developer"):
            system_chars += len(text)
        else:
            num_turns += 1
            if role == "user":
                last_user = text
    return RequestView("\n".join(parts), last_user, num_turns, system_chars, max_tokens)


def dense_features(view: RequestView) -> list[float]:
    """The numeric features, in the order of `DENSE_FEATURE_NAMES`."""
    text = view.text
    num_chars = len(text) or 1
    words = _WORD.findall(text)
    num_words = len(words) or 1
    log1p = math.log1p
    return [
        log1p(len(text)),
        log1p(len(words)),
        log1p(len(text.split())),
        log1p(len(_TOKEN.findall(text))),
        log1p(text.count("\n") + 1),
        log1p(len(view.last_user)),
        log1p(view.num_turns),
        log1p(view.system_chars),
        log1p(text.count("```")),
        log1p(len(_NUMBER.findall(text))),
        sum(map(str.isdigit, text)) / num_chars,
        log1p(len(_OPERATOR.findall(text))),
        log1p(len(_MATH_SYMBOL.findall(text))),
        log1p(text.count("?")),
        log1p(len(_LIST_MARKER.findall(text))),
        log1p(len(_CAPS_WORD.findall(text))),
        log1p(len(_ROMAN_OPTION.findall(text))),
        sum(len(w) for w in words) / num_words,
        sum(len(w) >= 9 for w in words) / num_words,
        len({w.lower() for w in words}) / num_words,
        sum(map(str.isupper, text)) / num_chars,
        (len(text) - len(text.encode("ascii", "ignore"))) / num_chars,
        log1p(view.max_tokens or 0),
        1.0 if view.max_tokens else 0.0,
    ]


def text_tokens(text: str) -> list[str]:
    """Lower-cased word and symbol unigrams and bigrams; every number becomes `<num>`.

    The analyzer of the TF-IDF step. Numbers are folded because their values name a
    question, not its difficulty; symbols are kept because they mark maths and code.
    """
    toks = ["<num>" if t.isdigit() else t for t in _TOKEN.findall(text.lower())]
    return toks + [f"{a} {b}" for a, b in zip(toks, toks[1:], strict=False)]
