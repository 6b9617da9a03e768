"""Cheap, deterministic request features for the difficulty classifier.

Everything here is pure Python (regexes and counting), so the gateway can score a
request without scikit-learn. Training wraps the same two functions, `dense_features`
and `text_tokens`, in a scikit-learn pipeline; inference in `cascade.artifact` calls
`analyze`, which computes both from one tokenisation, so train and serve cannot drift
apart. Change any feature and bump `FEATURE_VERSION`: an artifact built with another
version is refused at load time.

Cost is bounded: only a window of the text (its first and last `WINDOW_CHARS / 2`
characters) is scanned; counts are scaled up by `len(text) / len(window)`, and the
total length is exact. Scoring a request is therefore well under a millisecond
whatever the prompt's size.
"""

import math
import re
from dataclasses import dataclass

FEATURE_VERSION = "features-v2"
WINDOW_CHARS = 4096

_TOKEN = re.compile(r"\w+|[^\w\s]")  # a rough stand-in for BPE tokens: words and symbols
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_OPERATOR_CHARS = "+*/=^<>%|"
_MINUS = re.compile(r"[-−](?=[\s\d])")  # and preceded by a space or digit, checked by hand
_MATH_SYMBOL = re.compile(r"[$\\∫∑√π≤≥≠×÷∞∈∀∃θλμσ]")
_LIST_MARKER = re.compile(r"^[ \t]*(?:[-*•]|\d{1,3}[.)]|[A-Za-z][.)])[ \t]", re.MULTILINE)
_CAPS_WORD = re.compile(r"[A-Z]{2,}")
_ROMAN = frozenset(("I", "II", "III", "IV"))
_DIGITS = b"0123456789"
_UPPER = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"

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


def text_window(text: str) -> tuple[str, float]:
    """(the scanned part of `text`, how much longer the whole text is than that part)."""
    if len(text) <= WINDOW_CHARS:
        return text, 1.0
    half = WINDOW_CHARS // 2
    window = text[:half] + "\n" + text[-half:]
    return window, len(text) / len(window)


def _num_operators(window: str) -> int:
    minus = sum(
        1
        for m in _MINUS.finditer(window)
        if m.start() > 0 and (window[m.start() - 1].isspace() or window[m.start() - 1].isdecimal())
    )
    return sum(map(window.count, _OPERATOR_CHARS)) + minus


def _dense(view: RequestView, window: str, scale: float, toks: list[str]) -> list[float]:
    # a _TOKEN match is a \w+ run unless it is one non-word character
    words = [t for t in toks if len(t) > 1 or t.isalnum() or t == "_"]
    num_words = len(words) or 1
    num_chars = len(window) or 1
    lengths = list(map(len, words))
    caps = sum(1 for w in filter(str.isupper, words) if _CAPS_WORD.fullmatch(w))
    ascii_bytes = window.encode("ascii", "ignore")

    def log_count(n: float) -> float:
        return math.log1p(n * scale)

    return [
        math.log1p(len(view.text)),
        log_count(len(words)),
        log_count(len(window.split())),
        log_count(len(toks)),
        log_count(window.count("\n") + 1),
        math.log1p(len(view.last_user)),
        math.log1p(view.num_turns),
        math.log1p(view.system_chars),
        log_count(window.count("```")),
        log_count(len(_NUMBER.findall(window))),
        (len(ascii_bytes) - len(ascii_bytes.translate(None, _DIGITS))) / num_chars,
        log_count(_num_operators(window)),
        log_count(len(_MATH_SYMBOL.findall(window))),
        log_count(window.count("?")),
        log_count(len(_LIST_MARKER.findall(window))),
        log_count(caps),
        log_count(sum(map(_ROMAN.__contains__, words))),
        sum(lengths) / num_words,
        sum(map((8).__lt__, lengths)) / num_words,
        len(set(map(str.lower, words))) / num_words,
        (len(ascii_bytes) - len(ascii_bytes.translate(None, _UPPER))) / num_chars,
        (len(window) - len(ascii_bytes)) / num_chars,
        math.log1p(view.max_tokens or 0),
        1.0 if view.max_tokens else 0.0,
    ]


def _ngrams(toks: list[str]) -> list[str]:
    uni = list(map(str.lower, toks))
    if any(map(str.isdigit, uni)):
        uni = ["<num>" if t.isdigit() else t for t in uni]
    return uni + list(map(" ".join, zip(uni, uni[1:], strict=False)))


def dense_features(view: RequestView) -> list[float]:
    """The numeric features, in the order of `DENSE_FEATURE_NAMES`.

    Counts are of the text window, scaled to the whole text, as log1p; fractions
    (ASCII digits, ASCII capitals, non-ASCII characters, word statistics) are of the
    window; total, last-user and system lengths are exact.
    """
    window, scale = text_window(view.text)
    return _dense(view, window, scale, _TOKEN.findall(window))


def text_tokens(text: str) -> list[str]:
    """Lower-cased word and symbol unigrams and bigrams of the window; numbers -> `<num>`.

    The analyzer of the TF-IDF step. Numbers are folded because their values name a
    question, not its difficulty; symbols are kept because they mark maths and code.
    """
    return _ngrams(_TOKEN.findall(text_window(text)[0]))


def analyze(view: RequestView) -> tuple[list[float], list[str]]:
    """`(dense_features(view), text_tokens(view.text))` from one scan of the window."""
    window, scale = text_window(view.text)
    toks = _TOKEN.findall(window)
    return _dense(view, window, scale, toks), _ngrams(toks)
