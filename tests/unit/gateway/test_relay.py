"""The SSE relay reads only the events that carry usage or an error; every other event is
forwarded as bytes and counted as one token."""

import asyncio
import json
import time

import pytest

from gateway.serving import relay as relay_mod
from gateway.serving.flight import Attempt
from gateway.serving.plan import Plan
from gateway.serving.relay import StreamHandedOver, relay
from gateway.serving.resume import StreamLog


class Upstream:
    """A worker's streaming body, handed over in the pieces given."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def aiter_raw(self):
        for piece in self.pieces:
            yield piece


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"  # spaced, unlike the worker's


def token(text: str) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    return event({"id": "c", "object": "text_completion", "choices": [choice]})


USAGE = event(
    {
        "id": "c",
        "object": "text_completion",
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
)
DONE = b"data: [DONE]\n\n"


def make_plan(wants_usage: bool, **fields) -> Plan:
    base = dict(
        request_id="gw-1",
        tenant_id="acme",
        pool="small",
        route="forced",
        chat=False,
        stream=True,
        wants_usage=wants_usage,
        client_logprobs=False,
        prompt_tokens=5,
        max_tokens=16,
        deadline=time.monotonic() + 5,
        affinity=None,
    )
    return Plan(**{**base, **fields})


def run(
    pieces: list[bytes], wants_usage: bool, max_bytes: int = 1 << 20, **plan
) -> tuple[bytes, Attempt]:
    attempt = Attempt(lease=None)

    async def go() -> bytes:
        stream = relay(Upstream(pieces), attempt, make_plan(wants_usage, **plan), 5, max_bytes)
        return b"".join([b async for b in stream])

    return asyncio.run(go()), attempt


@pytest.mark.parametrize("wants_usage", [True, False])
def test_output_chunks_are_counted_without_decoding_and_usage_is_read(monkeypatch, wants_usage):
    decoded = []
    real = relay_mod.parse_chunk
    monkeypatch.setattr(relay_mod, "parse_chunk", lambda d: decoded.append(d) or real(d))
    # Text that spells the keys the relay looks for, as a model could write it.
    tricky = token('he said "usage": {"error": 1}, "choices": [{')
    stream = token("a") + tricky + token("c") + USAGE + DONE
    # Cut into pieces that split events, as TCP may.
    pieces = [stream[i : i + 7] for i in range(0, len(stream), 7)]
    body, attempt = run(pieces, wants_usage)
    assert attempt.served.tokens_relayed == 3
    assert attempt.served.usage_completion_tokens == 3
    assert decoded == [USAGE[6:-2]]  # only the usage event was decoded
    expected = token("a") + tricky + token("c") + (USAGE if wants_usage else b"") + DONE
    assert body == expected


def test_an_error_event_is_forwarded_and_ends_the_stream():
    error = event({"error": {"message": "boom", "type": "server_error", "code": None}})
    body, attempt = run([token("a") + error + token("never")], True)
    assert body == token("a") + error + DONE
    assert attempt.served.tokens_relayed == 1


def test_a_handed_over_stream_raises_before_the_client_sees_it_when_it_can_be_resumed():
    """A draining worker's `handed_over` event: for a resumable stream (one with a log) the
    tokens before it go out and the relay raises, so the stream goes on elsewhere; for any
    other it is an error event as before."""
    handed = event(
        {"error": {"message": "draining", "type": "server_error", "code": "handed_over"}}
    )
    ids = b'data: {"id":"c","choices":[{"index":0,"text":"a","finish_reason":null,"token_ids":[9],"text_chars":1}]}\n\n'  # noqa: E501
    attempt = Attempt(lease=None)
    log = StreamLog()
    got: list[bytes] = []

    async def go() -> None:
        async for b in relay(Upstream([ids + handed]), attempt, make_plan(False), 5, 1 << 20, log):
            got.append(b)

    with pytest.raises(StreamHandedOver):
        asyncio.run(go())
    assert (
        b"".join(got)
        == b'data: {"id":"c","choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
    )
    assert log.token_ids == [9] and log.text_chars(chat=False) == 1
    body, _ = run([token("a") + handed], True)  # not resumable: relayed, and the end
    assert body == token("a") + handed + DONE


def chat(delta: dict, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return event({"id": "c", "object": "chat.completion.chunk", "choices": [choice]})


def test_a_foreign_role_only_first_chunk_is_relayed_but_is_not_a_token():
    role = chat({"role": "assistant", "content": None})  # llama-server's, before any token
    first = chat({"role": "assistant", "content": "Hi"})  # a worker's: role and first token
    out, attempt = run([role, chat({"content": "Hello"}), chat({"content": "!"}), DONE], False)
    assert out.count(b"data: ") == 4 and attempt.served.tokens_relayed == 2
    out, attempt = run([first, chat({"content": "!"}), DONE], False)
    assert attempt.served.tokens_relayed == 2
    empty = chat({"role": "assistant", "content": ""})  # vLLM's
    _, attempt = run([empty, chat({"tool_calls": [{"index": 0}]}), DONE], False)
    assert attempt.served.tokens_relayed == 1


def test_usage_on_a_last_output_chunk_is_stripped_unless_asked():
    last = event(
        {
            "id": "c",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        }
    )
    out, attempt = run([token("a"), token("b"), last, DONE], False)
    assert b'"usage"' not in out and b'"finish_reason":"length"' in out
    assert attempt.served.usage_completion_tokens == 2
    out, _ = run([token("a"), token("b"), last, DONE], True)
    assert b'"usage"' in out
