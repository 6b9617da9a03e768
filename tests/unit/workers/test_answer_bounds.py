"""The size of one answer's logprobs is bounded at validation: n x max_tokens x (1 + top
alternatives) entries at most `RequestLimits.max_logprob_entries`, else a 400 that names the
fields (chat: `top_logprobs`; completions: `logprobs`; with `n` and the max-tokens field).
And what is within the bound is built as it arrives (`ChoiceLogprobs`): finishing an answer
joins encoded fragments, with no walk over its entries."""

import json

import msgspec
import pytest

from gateway.config import GatewayConfig
from gateway.serving.intake import decode as gateway_decode
from workers.api.types import ApiError, ChatCompletionRequest, CompletionRequest, decode_request
from workers.api.validation import RequestLimits, check_request
from workers.engine.outputs import TokenLogprobs
from workers.server.logprobs import ChoiceLogprobs, TokenTexts

LIMITS = RequestLimits(max_logprob_entries=2100)  # n=4 x 25 tokens x (1 + 20)
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**kw) -> ChatCompletionRequest:
    raw = json.dumps({"model": "m", "messages": MESSAGES, **kw}).encode()
    return decode_request(raw, ChatCompletionRequest)


def completion(**kw) -> CompletionRequest:
    return decode_request(
        json.dumps({"model": "m", "prompt": "x", **kw}).encode(), CompletionRequest
    )


def refusal(req, default_max_tokens: int | None = None) -> ApiError:  # noqa: ANN001
    with pytest.raises(ApiError) as caught:
        check(req, default_max_tokens)
    assert caught.value.status == 400 and caught.value.code == "logprobs_too_large"
    return caught.value


def check(req, default_max_tokens: int | None = None) -> None:  # noqa: ANN001
    check_request(
        req, LIMITS, vocab_size=None, max_model_len=None, default_max_tokens=default_max_tokens
    )


def test_chat_at_the_bound_is_served_and_one_token_more_is_a_400_naming_the_fields():
    check(chat(n=4, max_tokens=25, logprobs=True, top_logprobs=20))
    error = refusal(chat(n=4, max_tokens=26, logprobs=True, top_logprobs=20))
    assert error.param == "top_logprobs"
    for part in ("n (4)", "max_tokens (26)", "top_logprobs (20)", "2184", "2100"):
        assert part in error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_chat_names_max_completion_tokens_when_that_is_the_budget():
    error = refusal(chat(n=4, max_completion_tokens=26, logprobs=True, top_logprobs=20))
    assert "max_completion_tokens (26)" in error.message


def test_chat_logprobs_alone_count_one_entry_per_token():
    check(chat(n=4, max_tokens=525, logprobs=True))
    assert "top_logprobs (0)" in refusal(chat(n=4, max_tokens=526, logprobs=True)).message


def test_completions_name_logprobs():
    check(completion(n=4, max_tokens=25, logprobs=20))
    error = refusal(completion(n=4, max_tokens=26, logprobs=20))
    assert error.param == "logprobs" and "logprobs (20)" in error.message


def test_without_max_tokens_the_workers_default_budget_counts():
    req = chat(n=4, logprobs=True, top_logprobs=20)
    check(req)  # no budget known (the gateway before it fills one in): left to the worker
    check(req, default_max_tokens=25)
    assert "max_tokens (26)" in refusal(req, default_max_tokens=26).message


def test_no_logprobs_no_bound():
    check(chat(n=16, max_tokens=4096))
    check(completion(n=16, max_tokens=4096))


def test_the_gateway_refuses_an_explicit_budget_over_the_default_bound():
    body = {"model": "m", "messages": MESSAGES, "n": 16, "max_tokens": 1024}
    raw = json.dumps({**body, "logprobs": True, "top_logprobs": 20}).encode()
    with pytest.raises(ApiError) as caught:
        gateway_decode(raw, True, GatewayConfig())
    assert (caught.value.status, caught.value.param) == (400, "top_logprobs")
    gateway_decode(json.dumps(body).encode(), True, GatewayConfig())


class _Tokenizer:
    """Token i decodes to a word; counts decodes."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        return {7: "é"}.get(token_ids[0], f"w{token_ids[0]}")


def _steps():
    """Three engine steps' worth of (entries, token ids)."""
    return [
        ([TokenLogprobs(-0.5, [(7, -0.5), (3, -1.0)])], [7]),
        ([TokenLogprobs(-0.25, [(3, -0.25), (7, -2.0)])], [3]),
        ([TokenLogprobs(-1.5, [(4, -0.1), (3, -1.5)]), TokenLogprobs(-0.1, [])], [3, 4]),
    ]


@pytest.mark.parametrize("chat_shape", [True, False], ids=["chat", "completions"])
def test_a_whole_answers_logprobs_are_its_stream_deltas_joined(chat_shape):
    whole = ChoiceLogprobs(TokenTexts(_Tokenizer()), chat_shape)
    stream = ChoiceLogprobs(TokenTexts(_Tokenizer()), chat_shape)
    deltas = []
    for entries, ids in _steps():
        whole.add(entries, ids)
        deltas.append(stream.delta(entries, ids))
    got = msgspec.json.decode(msgspec.json.encode({"lp": whole.value()}))["lp"]
    if chat_shape:
        assert got == {"content": [c for d in deltas for c in d["content"]], "refusal": None}
        assert got["content"][0] == {
            "token": "é",
            "logprob": -0.5,
            "bytes": [195, 169],
            "top_logprobs": [
                {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
                {"token": "w3", "logprob": -1.0, "bytes": [119, 51]},
            ],
        }
    else:
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        assert got == {k: [v for d in deltas for v in d[k]] for k in keys}
        assert got["tokens"] == ["é", "w3", "w3", "w4"]
        assert got["text_offset"] == [0, 1, 3, 5]  # counted across steps
        assert got["top_logprobs"][0] == {"é": -0.5, "w3": -1.0}


def test_finishing_an_answer_does_no_work_per_entry():
    tok = _Tokenizer()
    texts = TokenTexts(tok)
    lps = ChoiceLogprobs(texts, chat=True)
    for entries, ids in _steps():
        lps.add(entries, ids)
    lps._texts = None  # type: ignore[assignment]  # any lookup now would raise
    value = lps.value()
    assert isinstance(value, msgspec.Raw) and len(msgspec.json.decode(value)["content"]) == 4


def test_each_token_text_is_decoded_once_for_the_workers_life():
    tok = _Tokenizer()
    texts = TokenTexts(tok)
    for _ in range(3):
        lps = ChoiceLogprobs(texts, chat=True)
        for entries, ids in _steps():
            lps.add(entries, ids)
    assert tok.calls == len(texts) == 3  # ids 3, 4 and 7
    assert TokenTexts(None)(42) == ("42", [52, 50])  # no tokenizer: the id
