"""Request features: deterministic, chat-aware, numbers folded."""

import math
import re

import pytest

from cascade.features import (
    DENSE_FEATURE_NAMES,
    WINDOW_CHARS,
    analyze,
    dense_features,
    request_view,
    text_tokens,
    text_window,
)


def test_features_are_deterministic_and_named() -> None:
    view = request_view("What is 12 + 30?\n```py\nx = 1\n```\n- a\n- b", max_tokens=256)
    first, second = dense_features(view), dense_features(view)
    assert first == second
    assert len(first) == len(DENSE_FEATURE_NAMES)
    named = dict(zip(DENSE_FEATURE_NAMES, first, strict=True))
    assert named["log_code_fences"] > 0 and named["log_list_markers"] > 0
    assert named["log_question_marks"] > 0 and named["has_max_tokens"] == 1.0
    assert named["log_operators"] > 0


def test_longer_prompt_has_larger_length_features() -> None:
    short = dense_features(request_view("a short one"))
    long = dense_features(request_view("a much longer prompt " * 40))
    for name in ("log_chars", "log_words", "log_whitespace_tokens", "log_approx_tokens"):
        i = DENSE_FEATURE_NAMES.index(name)
        assert long[i] > short[i], name


def test_chat_view_counts_turns_and_system_prompt() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": "Prove it."}]},
    ]
    view = request_view("ignored", messages)
    assert view.num_turns == 3
    assert view.system_chars == len("You are terse.")
    assert view.last_user == "Prove it."
    assert "ignored" not in view.text and "Prove it." in view.text
    assert request_view("", ["junk", {"role": "user", "content": None}]).text == ""


def test_text_tokens_fold_numbers_and_add_bigrams() -> None:
    toks = text_tokens("Add 12 and 30!")
    assert "<num>" in toks and "12" not in toks
    assert "add <num>" in toks and "!" in toks
    assert toks == text_tokens("Add 99 and 7!")


def test_analyze_matches_the_training_functions() -> None:
    for text in ["", "Ünïcode wörds_and 3.14 − 2 = x?", "IV. II III NOT ABC1 x-1 5 - 3\n1) a"]:
        view = request_view(text, max_tokens=16)
        assert analyze(view) == (dense_features(view), text_tokens(text))


def test_word_counts_agree_with_the_word_regex() -> None:
    text = "Ünïcode wörds_and 3.14, don't stop; ＡＢ 数学 x²"
    i = DENSE_FEATURE_NAMES.index("log_words")
    assert dense_features(request_view(text))[i] == math.log1p(len(re.findall(r"\w+", text)))


def test_long_prompts_are_scanned_in_a_window_and_counted_in_full() -> None:
    base = "Which of the following is true? " * 100  # 3,200 chars
    long = base * 20
    window, scale = text_window(long)
    assert len(window) <= WINDOW_CHARS + 1 and scale == pytest.approx(len(long) / len(window))
    short_f, long_f = dense_features(request_view(base)), dense_features(request_view(long))
    i_chars = DENSE_FEATURE_NAMES.index("log_chars")
    i_q = DENSE_FEATURE_NAMES.index("log_question_marks")
    assert long_f[i_chars] == pytest.approx(math.log1p(len(long)))
    assert long_f[i_q] == pytest.approx(math.log1p(2000), rel=0.01)  # 2,000 "?" in all
    assert long_f[i_q] > short_f[i_q]
