"""Request bounds (workers.api.validation): pure, no torch, no server."""

import json

import msgspec
import pytest

from workers.api.types import ApiError, ChatCompletionRequest, CompletionRequest
from workers.api.validation import (
    SEED_MAX,
    SEED_MIN,
    RequestLimits,
    check_body_size,
    check_json_depth,
    check_request,
)

VOCAB = 1000
MAX_LEN = 256


def completion(**kw) -> CompletionRequest:
    return msgspec.convert(
        {"model": "m", "prompt": "hello", "max_tokens": 8, **kw}, CompletionRequest
    )


def chat(**kw) -> ChatCompletionRequest:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    return msgspec.convert({**base, **kw}, ChatCompletionRequest)


def refused(req, limits: RequestLimits | None = None, **kw) -> ApiError:
    bounds = {"vocab_size": VOCAB, "max_model_len": MAX_LEN, **kw}
    with pytest.raises(ApiError) as info:
        check_request(req, limits, **bounds)
    return info.value


BAD_COMPLETIONS = [
    ({"seed": SEED_MAX + 1}, "seed"),
    ({"seed": SEED_MIN - 1}, "seed"),
    ({"seed": 10**40}, "seed"),
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9}, "min_tokens"),  # above max_tokens=8
    ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["x" * 257]}, "stop"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
    ({"prompt": [1, 2, VOCAB]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1] * MAX_LEN}, "prompt"),  # the prompt alone fills the context
    ({"prompt": [1] * 250, "max_tokens": 7}, "max_tokens"),  # 257 > 256
    ({"max_tokens": MAX_LEN}, "max_tokens"),  # no room left for any prompt
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"priority": 2**31}, "priority"),
    ({"priority": -(2**31) - 1}, "priority"),
    ({"cache_salt": "s" * 257}, "cache_salt"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_COMPLETIONS)
def test_each_bad_completion_value_is_refused_naming_its_parameter(patch, param):
    err = refused(completion(**patch))
    assert (err.status, err.param) == (400, param), err.message
    assert err.type == "invalid_request_error" and err.message


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}] * 2049}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "x": 1}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]},
        "messages",
    ),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": MAX_LEN}, "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": SEED_MAX + 1}, "seed"),
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"stop_token_ids": [VOCAB + 5]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_CHATS)
def test_each_bad_chat_value_is_refused_naming_its_parameter(patch, param):
    err = refused(chat(**patch))
    assert (err.status, err.param) == (400, param), err.message


GOOD_COMPLETIONS = [
    {"seed": SEED_MAX},
    {"seed": SEED_MIN},
    {"seed": -1},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": VOCAB},
    {"top_p": 1.0},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"temperature": 0},
    {"temperature": 2.0},
    {"presence_penalty": -2.0},
    {"min_tokens": 8},
    {"num_speculative_tokens": 0},
    {"num_speculative_tokens": 64},
    {"stop": ["a", "b", "c", "d"]},
    {"stop": "x" * 256},
    {"stop_token_ids": [0, VOCAB - 1]},
    {"prompt": [0, VOCAB - 1]},
    {"prompt": ["one string"]},
    {"prompt": [1] * 248},  # 248 + 8 = 256: exactly fits
    {"max_tokens": None},
    {"logprobs": 20},
    {"logprobs": 0},
]


@pytest.mark.parametrize("patch", GOOD_COMPLETIONS)
def test_values_at_the_bounds_are_accepted(patch):
    check_request(completion(**patch), vocab_size=VOCAB, max_model_len=MAX_LEN)


def test_a_good_chat_with_text_parts_is_accepted():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = chat(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": parts}])
    check_request(req, vocab_size=VOCAB, max_model_len=MAX_LEN, limits=None)
    check_request(chat(logprobs=True, top_logprobs=20), vocab_size=VOCAB, max_model_len=MAX_LEN)


def test_unknown_vocab_and_context_skip_those_checks_but_keep_64_bit_bounds():
    check_request(
        completion(prompt=[5000], top_k=5000, stop_token_ids=[9999], max_tokens=10**6),
        vocab_size=None,
        max_model_len=None,
    )
    assert refused(completion(top_k=2**40), vocab_size=None, max_model_len=None).param == "top_k"
    err = refused(completion(stop_token_ids=[2**40]), vocab_size=None, max_model_len=None)
    assert err.param == "stop_token_ids"
    assert refused(completion(seed=2**64), vocab_size=None, max_model_len=None).param == "seed"


def test_context_refusals_carry_the_openai_code():
    assert refused(completion(max_tokens=MAX_LEN)).code == "context_length_exceeded"


def test_limits_are_configurable():
    tight = RequestLimits(max_stop_strings=1, max_logprobs=2, max_messages=1)
    assert refused(completion(stop=["a", "b"]), tight).param == "stop"
    assert refused(completion(logprobs=3), tight).param == "logprobs"
    two = [{"role": "user", "content": "a"}] * 2
    assert refused(chat(messages=two), tight).param == "messages"


def test_body_size_bound_is_a_413():
    check_body_size(100, RequestLimits(max_body_bytes=100))
    with pytest.raises(ApiError) as info:
        check_body_size(101, RequestLimits(max_body_bytes=100))
    assert info.value.status == 413 and info.value.code == "request_too_large"


def nested(depth: int) -> bytes:
    return ("[" * depth + "]" * depth).encode()


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b'{"a": 1}', 1),
        (b'{"a": [1, {"b": [2]}]}', 4),
        (nested(40), 40),
        (b'{"x": ' + nested(20) + b', "y": ' + nested(33) + b"}", 34),
        (b"[" * 50, 50),  # truncated: never closes
        ((b"[[]" * 40) + (b"]" * 40), 41),
        (b"[]" * 10_000, 1),
        ((b"[" * 5 + b"]" * 5) * 10_000, 5),
    ],
)
def test_json_depth_is_measured_exactly_for_each_shape(raw, depth):
    check_json_depth(raw, depth)
    with pytest.raises(ApiError) as info:
        check_json_depth(raw, depth - 1)
    assert info.value.status == 400 and info.value.code == "json_too_deep"


def test_brackets_inside_strings_and_escapes_do_not_count():
    text = '[[[[{{{{ \\" [[[[ ' * 100
    raw = json.dumps({"model": "m", "prompt": text, "stop": ["]]]]", '"[[[']}).encode()
    check_json_depth(raw, 2)
    with pytest.raises(ApiError):
        check_json_depth(json.dumps({"a": [[text]]}).encode(), 2)


def test_json_depth_scan_of_a_huge_hostile_body_is_fast():
    import time

    for raw in (b"[" * 8_000_000, b"[]" * 4_000_000, (b"[" * 30 + b"]" * 30) * 130_000):
        t0 = time.perf_counter()
        try:
            check_json_depth(raw, 32)
        except ApiError:
            pass
        assert time.perf_counter() - t0 < 2.0
