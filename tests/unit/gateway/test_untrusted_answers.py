"""Numbers and bytes from a worker are untrusted: a Retry-After is parsed defensively, usage
is billed clamped to what the request could have produced, and the SSE relay bounds what a
stream may take and tells the client the usage it is billed."""

import asyncio
import json

import pytest

from gateway.serving.dispatch import _retry_after
from gateway.serving.flight import Attempt
from gateway.serving.plan import Served, billed, charge
from gateway.serving.relay import relay
from tests.unit.gateway.test_plan import plan
from tests.unit.gateway.test_relay import DONE, Upstream, event, make_plan, run, token
from workers.api.client import UpstreamError


class Headers:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


@pytest.mark.parametrize(
    "value, seconds",
    [
        ("1.5", 1.5),
        ("0", 0.0),
        ("nan", 0.2),
        ("NaN", 0.2),
        ("inf", 0.2),
        ("1e999", 0.2),
        ("-3", 0.2),
        ("soon", 0.2),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.2),
        (None, 0.2),
    ],
)
def test_a_retry_after_that_is_not_a_finite_non_negative_number_is_the_default(value, seconds):
    headers = {} if value is None else {"retry-after": value}
    assert _retry_after(Headers(headers)) == seconds  # type: ignore[arg-type]


def test_usage_past_what_the_request_could_produce_is_clamped_to_its_budget():
    """plan(): 10 prompt tokens, max_tokens 20, n 1; the worker claims 10**15 of each."""
    lie = Served(accepted=True, usage_prompt_tokens=10**15, usage_completion_tokens=10**15)
    bill = billed(plan(), lie)
    assert (bill.prompt_tokens, bill.completion_tokens, bill.total_tokens) == (10, 20, 30)
    assert charge(plan(n=3), lie) == 10 + 3 * 20


def test_a_streams_usage_is_clamped_to_the_tokens_relayed():
    lie = Served(
        accepted=True, usage_prompt_tokens=10, usage_completion_tokens=20, tokens_relayed=4
    )
    assert billed(plan(stream=True), lie).completion_tokens == 4
    assert billed(plan(stream=False), lie).completion_tokens == 20


def test_negative_usage_bills_nothing_and_cached_tokens_stay_within_the_prompt():
    odd = Served(accepted=True, usage_prompt_tokens=-5, usage_completion_tokens=-7)
    assert billed(plan(), odd).total_tokens == 0
    cached = Served(
        accepted=True, usage_prompt_tokens=8, usage_completion_tokens=1, usage_cached_tokens=99
    )
    details = billed(plan(), cached).prompt_tokens_details
    assert details is not None and details.cached_tokens == 8


def usage_event(prompt: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    usage["total_tokens"] = prompt + completion
    return event({"id": "c", "object": "text_completion", "choices": [], "usage": usage})


def test_a_streams_usage_claiming_more_than_was_relayed_is_forwarded_as_billed():
    stream = token("a") + token("b") + usage_event(5, 10**15) + DONE
    body, attempt = run([stream], wants_usage=True)
    events = [json.loads(e[6:]) for e in body.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert events[-1]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": None,
    }
    assert attempt.served.tokens_relayed == 2


def test_an_honest_usage_event_is_forwarded_as_sent():
    honest = usage_event(5, 2)
    body, _ = run([token("a") + token("b") + honest + DONE], wants_usage=True)
    assert body.endswith(honest + DONE)


def test_an_event_that_never_ends_is_cut_at_max_bytes():
    """One event that never ends, in 1-byte pieces: cut past the bound (16 KiB), not held
    until the stream's deadline."""
    pieces = [b"data: "] + [b"x"] * (1 << 20)
    with pytest.raises(UpstreamError, match="16384 bytes"):
        run(pieces, wants_usage=False, max_bytes=16384)


def test_a_stream_past_max_bytes_of_well_formed_events_is_cut():
    with pytest.raises(UpstreamError):
        run([token("a")] * 10_000, wants_usage=False, max_bytes=100_000)


def test_bytes_after_done_stop_the_drain_so_the_connection_is_not_kept():
    """After [DONE] only the chunked terminator is due: a byte of body there is unasked
    for, so the relay stops reading and the unfinished body closes the connection."""

    class Counting(Upstream):
        def __init__(self, pieces: list[bytes]) -> None:
            super().__init__(pieces)
            self.read = 0

        async def aiter_raw(self):
            for piece in self.pieces:
                self.read += 1
                yield piece

    upstream = Counting([token("a") + DONE, b"data: more\n\n", b"and more", b"and more"])
    attempt = Attempt(lease=None)

    async def go() -> bytes:
        chunks = relay(upstream, attempt, make_plan(False), 5, 1 << 20)
        return b"".join([b async for b in chunks])

    assert asyncio.run(go()) == token("a") + DONE
    assert upstream.read == 2  # the first piece after [DONE] ends the drain
