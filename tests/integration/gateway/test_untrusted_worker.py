"""A worker is untrusted input: a real gateway (real HTTP, real Redis) in front of a worker
that misbehaves on the wire (`rogue_worker.RogueWorker`). Whatever the worker sends, the
client gets its own answer or a 502/503 in the OpenAI error shape, never a 500 and never
bytes meant for someone else, and the tenant's books stay right. A slow worker, still
sending or answering late, keeps the requests it holds."""

import pytest

from benchmarks.fake_backend import FakeBackend
from tests.integration.gateway.faults_support import (
    BIG,
    BODY,
    Background,
    assert_books,
    gateway_over,
    prompt_preferring,
    send,
    stream_body,
    this_minute,
    wait_until,
)
from tests.integration.gateway.rogue_worker import LEAK, RogueWorker
from tests.support.servers import serving

PROMPT_TOKENS = len(BODY["prompt"])
MAX_TOKENS = BODY["max_tokens"]


def assert_failed_cleanly(r, statuses=(502, 503)) -> None:  # noqa: ANN001
    """A refusal in the OpenAI error shape (a JSON answer, or an in-band error event on a
    stream already committed)."""
    if r.status == 200:
        assert r.done and r.code is not None, (r.status, r.events[-3:])
        error = next(e["error"] for e in r.events if isinstance(e, dict) and "error" in e)
    else:
        assert r.status in statuses, (r.status, r.body)
        assert r.headers["content-type"].startswith("application/json")
        error = r.body["error"]
    assert {"message", "type", "code"} <= set(error), error
    assert error["type"] == "server_error", error


# -- bounded bodies, and the deadline over the whole answer ---------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_endless_body_is_cut_at_the_answer_bound_and_its_connection_dropped(redis_url, stream):
    """A worker that sends a 200 and then junk without end: the gateway stops reading at
    the request's answer bound (1 MiB + 4 KiB a token here), answers 502 (in-band on a
    stream), and hangs up, so the worker cannot send much more than that; the client
    pays the prompt the worker took in."""
    with RogueWorker() as rogue, gateway_over(redis_url, {"small": [rogue.url]}, door=False) as s:
        key = s.tenant("endless", tokens_per_day=BIG)
        minute0 = this_minute()
        rogue.mode = "endless"
        body = stream_body() if stream else BODY
        r = send(s.url, key, body, headers={"x-request-timeout": "20"}, timeout_s=30)
        assert_failed_cleanly(r, (502,))
        assert r.code == "upstream_failed", (r.body, r.events[-2:])
        wait_until(lambda: rogue.dropped == 1, 10, "the gateway hung up on the worker")
        bound = s.gateway.config.upstream_min_answer_bytes + 4096 * MAX_TOKENS
        # What the sockets' buffers hold on top of what the gateway read (loopback: a few MiB)
        assert rogue.sent_bytes < bound + (16 << 20), rogue.sent_bytes
        told = PROMPT_TOKENS if stream else 0
        assert r.usage == told
        assert_books(s.url, key, PROMPT_TOKENS, minute0)


@pytest.mark.timeout(60)
def test_a_body_that_stops_coming_is_cut_at_the_request_deadline(redis_url):
    """The head and ten bytes of the body, then nothing: the request's deadline holds over
    the whole answer (the client's x-request-timeout: 408), not only its head."""
    with RogueWorker() as rogue, gateway_over(redis_url, {"small": [rogue.url]}, door=False) as s:
        key = s.tenant("stalled-body", tokens_per_day=BIG)
        minute0 = this_minute()
        rogue.mode = "stall_body"
        r = send(s.url, key, BODY, headers={"x-request-timeout": "1"}, timeout_s=10)
        assert r.status == 408 and r.code == "request_timeout", (r.status, r.body)
        assert r.elapsed_s < 5.0
        assert_books(s.url, key, PROMPT_TOKENS, minute0)


# -- bounded heads ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_200_mb_head_is_refused_at_64_kib_without_stalling_other_requests(redis_url, stream):
    """The worker starts a head it means to make 200 MB long. The gateway gives up on it
    past `upstream_max_head_bytes` and hangs up (the worker gets little of it out), so the
    request fails at once (503: its only replica failed before answering), and requests
    to another pool meanwhile are served as usual. (Before the bound, the gateway read the
    whole head, each piece of the header copied onto the ones before: 8 s of a stalled
    event loop for 200 MB.)"""
    other = FakeBackend(name="large0")
    with (
        RogueWorker() as rogue,
        serving(other) as other_url,
        gateway_over(redis_url, {"small": [rogue.url], "large": [other_url]}, door=False) as s,
    ):
        key = s.tenant("big-head", tokens_per_day=BIG, max_concurrent=8)
        minute0 = this_minute()
        rogue.mode = "big_head"
        bg = Background()
        bg.send(s.url, key, stream_body() if stream else BODY, timeout_s=60)
        wait_until(lambda: rogue.sent_bytes > 0, 10, "the worker began its head")
        others = [send(s.url, key, {**BODY, "model": "large"}, timeout_s=30) for _ in range(5)]
        r = bg.join(60)[0]
        assert_failed_cleanly(r, (503,))
        assert r.code == "upstream_unavailable", r.body
        assert r.elapsed_s < 5.0, r.elapsed_s
        # Each try (the only replica may be tried again) hung up on early.
        tries = len(rogue.posts)
        wait_until(lambda: rogue.dropped == tries, 10, "the gateway hung up on the worker")
        assert rogue.sent_bytes < tries * (32 << 20), (rogue.sent_bytes, tries)
        for o in others:
            assert o.status == 200 and o.elapsed_s < 2.0, (o.status, o.elapsed_s)
        assert_books(s.url, key, sum(o.usage for o in others), minute0)


# -- no byte that was not asked for ------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_second_answer_behind_the_first_reaches_no_one(redis_url, stream):
    """The worker answers tenant A and, in the same write, sends a second answer nobody
    asked for. A gets exactly its own answer; B, whose request comes next over the same
    kept-alive connection's worker, gets its own, never the second one."""
    with (
        RogueWorker() as rogue,
        gateway_over(redis_url, {"small": [rogue.url]}, door=False, max_inflight_per_worker=1) as s,
    ):
        key_a = s.tenant("tenant-a", tokens_per_day=BIG)
        key_b = s.tenant("tenant-b", tokens_per_day=BIG)
        minute0 = this_minute()
        body = stream_body() if stream else BODY
        rogue.mode = "two_answers"
        a = send(s.url, key_a, body)
        rogue.mode = "ok"
        b = send(s.url, key_b, body)
        for r in (a, b):
            assert r.status == 200, (r.status, r.body)
            if stream:
                text = "".join(e["choices"][0]["text"] for e in r.events[:-2])
                assert r.done and r.events[-2]["usage"]["completion_tokens"] == MAX_TOKENS
            else:
                assert isinstance(r.body, dict), r.body  # one JSON answer, nothing after it
                text = r.body["choices"][0]["text"]
            assert text == "r" * MAX_TOKENS, text
            assert LEAK not in str(r.body) + str(r.events)
        told = PROMPT_TOKENS + MAX_TOKENS
        assert a.usage == b.usage == told
        assert_books(s.url, key_a, told, minute0)
        assert_books(s.url, key_b, told, minute0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_interim_100_nobody_asked_for_is_a_503_not_a_500(redis_url, stream):
    """The gateway never sends `Expect: 100-continue`: a 100 is a byte it did not ask for.
    The try fails before any answer (its only replica: 503), nothing is charged."""
    with RogueWorker() as rogue, gateway_over(redis_url, {"small": [rogue.url]}, door=False) as s:
        key = s.tenant("continue", tokens_per_day=BIG)
        minute0 = this_minute()
        rogue.mode = "continue"
        r = send(s.url, key, stream_body() if stream else BODY)
        assert_failed_cleanly(r, (503,))
        assert r.code == "upstream_unavailable", r.body
        assert_books(s.url, key, 0, minute0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("status", [204, 302, 600], ids=["204", "302", "600"])
def test_a_status_outside_the_contract_is_a_502(redis_url, status):
    """Not a 200, a 4xx or a 5xx: the worker broke the contract; its status is not
    relayed (a client would follow a redirect, or choke on a 600)."""
    with RogueWorker() as rogue, gateway_over(redis_url, {"small": [rogue.url]}, door=False) as s:
        key = s.tenant("odd-status", tokens_per_day=BIG)
        minute0 = this_minute()
        rogue.mode, rogue.status = "status", status
        for body in (BODY, stream_body()):
            r = send(s.url, key, body)
            assert_failed_cleanly(r, (502,))
            assert r.code == "upstream_failed", r.body
        assert_books(s.url, key, 0, minute0)


# -- numbers from a worker are clamped, headers parsed defensively ---------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_usage_no_request_could_produce_is_clamped_and_the_tenant_is_not_locked_out(
    redis_url, stream
):
    """The worker claims 10**15 prompt and completion tokens for a 4-token prompt and 6
    tokens relayed. The tenant is billed, and told, at most what the request could have
    produced (prompt + n * max_tokens; on a stream, the tokens relayed), and its next
    request is served."""
    with RogueWorker() as rogue, gateway_over(redis_url, {"small": [rogue.url]}, door=False) as s:
        key = s.tenant("lied-to", tokens_per_day=100)
        minute0 = this_minute()
        rogue.mode = "usage_lie"
        body = stream_body() if stream else BODY
        lied = send(s.url, key, body)
        assert lied.status == 200, (lied.status, lied.body)
        usage = lied.events[-2]["usage"] if stream else lied.body["usage"]
        told = PROMPT_TOKENS + MAX_TOKENS
        assert usage["completion_tokens"] == MAX_TOKENS and usage["total_tokens"] == told
        rogue.mode = "ok"
        after = send(s.url, key, body)
        assert after.status == 200, (after.status, after.body)
        assert_books(s.url, key, 2 * told, minute0)


@pytest.mark.timeout(60)
def test_a_retry_after_of_nan_is_honoured_as_a_short_wait_not_a_500(redis_url):
    """A worker refusing with `Retry-After: nan`: the gateway waits its default instead,
    moves the request to the other replica, and serves it; with that replica refusing
    too, the client gets a 503 with a Retry-After it can use."""
    other = FakeBackend(name="small1")
    with (
        RogueWorker() as rogue,
        serving(other) as other_url,
        gateway_over(redis_url, {"small": [rogue.url, other_url]}, door=False) as s,
    ):
        views = s.gateway.pools["small"].views
        wait_until(lambda: all(v.state == "ready" for v in views.values()), 5, "both ready")
        key = s.tenant("nan", tokens_per_day=BIG)
        minute0 = this_minute()
        rogue.mode = "retry_nan"
        prompt = prompt_preferring(rogue.url, [rogue.url, other_url])
        served = send(s.url, key, {**BODY, "prompt": prompt})
        assert served.status == 200, (served.status, served.body)
        assert [p["prompt"] for p in rogue.posts] == [prompt]
        other.mode = "refuse"
        refused = send(s.url, key, {**BODY, "prompt": prompt})
        assert_failed_cleanly(refused, (503,))
        assert int(refused.headers["retry-after"]) >= 1
        assert_books(s.url, key, served.usage, minute0)


# -- a slow worker is not a lost one -----------------------------------------------------------


def _held_on_the_rogue(redis_url, lost_after_s: float, with_stream: bool):  # noqa: ANN202
    """A non-streaming request held by the rogue replica (the other is a fake backend),
    the rogue's polls held too: the poller sees it unreachable. `with_stream`: a stream on
    the rogue keeps sending meanwhile. Then the rogue answers. Returns both results, the
    fake's bodies and the tenant's books check."""
    other = FakeBackend(name="small1")
    with (
        RogueWorker() as rogue,
        serving(other) as other_url,
        gateway_over(
            redis_url,
            {"small": [rogue.url, other_url]},
            door=False,
            worker_lost_after_s=lost_after_s,
        ) as s,
    ):
        view = s.gateway.pools["small"].views[rogue.url]
        views = s.gateway.pools["small"].views.values()
        wait_until(lambda: all(v.state == "ready" for v in views), 5, "both ready")
        key = s.tenant("slow", tokens_per_day=BIG, max_concurrent=8)
        minute0 = this_minute()
        urls = [rogue.url, other_url]
        rogue.mode = "hold"
        bg = Background()
        if with_stream:
            bg.send(s.url, key, stream_body(prompt=prompt_preferring(rogue.url, urls, 1)))
            wait_until(lambda: len(rogue.posts) == 1, 5, "the stream is on the rogue")
        bg.send(s.url, key, {**BODY, "prompt": prompt_preferring(rogue.url, urls)}, timeout_s=30)
        wait_until(lambda: len(rogue.posts) == 1 + with_stream, 5, "held on the rogue")
        rogue.hold_polls.set()  # its event loop "busy": polls go unanswered
        wait_until(lambda: view.state == "unreachable", 10, "the poller sees it unreachable")
        rogue.hold_polls.clear()
        rogue.release.set()
        results = bg.join(20)
        told = sum(r.usage for r in results)
        assert_books(s.url, key, told, minute0)
        return results, list(other.bodies)


@pytest.mark.timeout(60)
def test_a_worker_busy_past_a_poll_keeps_the_answer_it_is_building(redis_url):
    """The rogue holds a non-streaming request and answers no poll for over 2 s (one
    missed poll: 1 s /load, 1 s /health), less than `worker_lost_after_s` (5 s): the
    request keeps waiting on it and gets its answer there, never a second replica's."""
    results, other_bodies = _held_on_the_rogue(redis_url, 5.0, with_stream=False)
    (r,) = results
    assert r.status == 200 and r.body["choices"][0]["text"] == "r" * MAX_TOKENS, r.body
    assert other_bodies == [], "retried on the other replica while the rogue was building"


@pytest.mark.timeout(60)
def test_a_worker_still_sending_is_not_lost_however_long_its_polls_go_unanswered(redis_url):
    """As above with `worker_lost_after_s` 1 s, shorter than the missed poll, while a
    stream from the rogue keeps sending: the worker is heard from, so it is not lost."""
    results, other_bodies = _held_on_the_rogue(redis_url, 1.0, with_stream=True)
    by_kind = {bool(r.events): r for r in results}
    assert by_kind[False].status == 200, by_kind[False].body
    assert by_kind[False].body["choices"][0]["text"] == "r" * MAX_TOKENS
    assert by_kind[True].status == 200 and by_kind[True].done
    assert other_bodies == [], "retried on the other replica while the rogue was sending"
