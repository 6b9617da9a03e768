"""Request fields are refused, never dropped: an OpenAI field this server does not implement
is a 400 naming it, at the worker and at the gateway (which decodes with the same structs),
and `logit_bias` is decoded and bounded (entries, token ids, values) at both ends."""

import json

import pytest

from gateway.config import GatewayConfig
from gateway.serving.intake import decode as gateway_decode
from workers.api.types import ApiError, ChatCompletionRequest, CompletionRequest, decode_request
from workers.api.validation import RequestLimits, check_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 8}

# OpenAI request fields (the Chat Completions and Completions references) the project does
# not implement: each would change what is generated, stored or billed if it were honoured.
CHAT_UNIMPLEMENTED = {
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "service_tier": "flex",
    "store": True,
    "metadata": {"a": "b"},
    "web_search_options": {},
    "verbosity": "low",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
    "echo": True,  # a completions field
}
COMPLETION_UNIMPLEMENTED = {
    "suffix": " the end",
    "best_of": 2,
    "max_completion_tokens": 8,  # a chat field
    "top_logprobs": 2,
    "logprobz": 1,  # a typo is not quietly ignored either
}


def _refusal(raw: dict, kind) -> ApiError:  # noqa: ANN001
    with pytest.raises(ApiError) as caught:
        decode_request(json.dumps(raw).encode(), kind)
    assert caught.value.status == 400
    return caught.value


def _gateway_refusal(raw: dict, chat: bool) -> ApiError:
    with pytest.raises(ApiError) as caught:
        gateway_decode(json.dumps(raw).encode(), chat, GatewayConfig())
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(("name", "value"), CHAT_UNIMPLEMENTED.items())
def test_an_unimplemented_chat_field_is_a_400_naming_it_at_worker_and_gateway(name, value):
    for error in (
        _refusal({**CHAT, name: value}, ChatCompletionRequest),
        _gateway_refusal({**CHAT, name: value}, chat=True),
    ):
        assert (error.param, error.code) == (name, "unknown_field")
        assert f"`{name}`" in error.message
        assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("name", "value"), COMPLETION_UNIMPLEMENTED.items())
def test_an_unimplemented_completion_field_is_a_400_naming_it_at_worker_and_gateway(name, value):
    for error in (
        _refusal({**COMPLETION, name: value}, CompletionRequest),
        _gateway_refusal({**COMPLETION, name: value}, chat=False),
    ):
        assert (error.param, error.code) == (name, "unknown_field")


def test_every_field_the_project_implements_still_decodes():
    common = {
        "temperature": 0.5, "top_p": 0.9, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}, "stop": ["x"], "seed": 3,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "user": "u", "priority": 1,
        "cache_salt": "s", "ignore_eos": True, "min_tokens": 1, "top_k": 5, "min_p": 0.1,
        "stop_token_ids": [7], "response_format": {"type": "json_object"},
        "logit_bias": {"5": 1.5, "9": -100}, "num_speculative_tokens": 2,
    }  # fmt: skip
    chat = {
        **CHAT, **common, "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 2,
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
        "parallel_tool_calls": False,
    }  # fmt: skip
    completion = {**COMPLETION, **common, "logprobs": 2, "echo": False}
    got = decode_request(json.dumps(chat).encode(), ChatCompletionRequest)
    assert got.logit_bias == {5: 1.5, 9: -100.0} and got.top_logprobs == 2
    assert decode_request(json.dumps(completion).encode(), CompletionRequest).logprobs == 2
    assert gateway_decode(json.dumps(chat).encode(), True, GatewayConfig()).n == 2
    assert gateway_decode(json.dumps(completion).encode(), False, GatewayConfig()).seed == 3
    # The gateway's own field stays the gateway's.
    raw = json.dumps({**COMPLETION, "switchyard_threshold": 0.5}).encode()
    assert gateway_decode(raw, False, GatewayConfig()).switchyard_threshold == 0.5
    assert _refusal({**COMPLETION, "switchyard_threshold": 0.5}, CompletionRequest).param == (
        "switchyard_threshold"
    )


@pytest.mark.parametrize(
    "bias",
    [{"a": 1}, {"1.5": 1}, {"5": "1"}, {"5": None}, [1, 2]],
    ids=["word-key", "float-key", "string-value", "null-value", "array"],
)
def test_a_logit_bias_of_the_wrong_shape_is_a_400_naming_it(bias):
    assert _refusal({**CHAT, "logit_bias": bias}, ChatCompletionRequest).param == "logit_bias"
    assert _gateway_refusal({**COMPLETION, "logit_bias": bias}, chat=False).param == "logit_bias"


def test_a_logit_bias_value_beyond_a_double_is_a_400_naming_it():
    raw = b'{"model": "m", "prompt": "x", "logit_bias": {"5": 1e400}}'
    with pytest.raises(ApiError) as caught:
        decode_request(raw, CompletionRequest)
    assert (caught.value.status, caught.value.param) == (400, "logit_bias")


def _check(bias: dict, vocab: int | None = 1000, limits: RequestLimits | None = None) -> None:
    req = decode_request(json.dumps({**CHAT, "logit_bias": bias}).encode(), ChatCompletionRequest)
    check_request(req, limits, vocab_size=vocab, max_model_len=None)


@pytest.mark.parametrize(
    ("bias", "vocab"),
    [
        ({"1000": 1}, 1000),  # beyond the vocabulary
        ({"-1": 1}, 1000),
        ({str(2**31): 1}, None),  # no vocabulary known: int32-sized ids only
        ({"5": 100.5}, 1000),
        ({"5": -100.01}, 1000),
        ({str(i): 1 for i in range(301)}, 1000),  # more entries than allowed (300)
    ],
    ids=["id-beyond-vocab", "negative-id", "id-beyond-int32", "over-100", "under-minus-100",
         "too-many"],
)  # fmt: skip
def test_a_logit_bias_out_of_bounds_is_a_400_naming_it(bias, vocab):
    with pytest.raises(ApiError) as caught:
        _check(bias, vocab)
    assert (caught.value.status, caught.value.param) == (400, "logit_bias")


def test_a_logit_bias_at_its_bounds_is_accepted():
    _check({"0": -100, "999": 100})
    _check({str(i): 1 for i in range(300)})
    _check({str(i): 1 for i in range(3)}, limits=RequestLimits(max_logit_bias=3))
    with pytest.raises(ApiError):
        _check({str(i): 1 for i in range(4)}, limits=RequestLimits(max_logit_bias=3))


def test_the_gateway_refuses_a_logit_bias_value_out_of_range_before_any_pool_is_known():
    error = _gateway_refusal({**CHAT, "logit_bias": {"5": 250}}, chat=True)
    assert error.param == "logit_bias" and "between -100 and 100" in error.message
