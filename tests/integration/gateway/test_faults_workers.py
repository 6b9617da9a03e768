"""Worker faults end to end: a SIGSTOPped or hung replica (requests move to another), every
replica refusing (a real 503), and a replica answering 400 (relayed once, never retried).
Every test ends by checking the tenant's books."""

import json
import os
import signal
import time

import httpx
import pytest

from benchmarks.fake_backend import FakeBackend
from tests.integration.gateway.conftest import Stack, gateway_stack
from tests.integration.gateway.faults_support import (
    BIG,
    BODY,
    Background,
    assert_books,
    gateway_over,
    prompt_preferring,
    send,
    stats,
    stream_body,
    this_minute,
    usage,
    wait_until,
)
from tests.support.servers import backend_proc, serving

# -- 4. A SIGSTOPped or hung worker -------------------------------------------------------


def record_posts(stack: Stack) -> list[tuple[str, list[int], bool]]:
    """Wrap the in-process gateway's worker client: every POST to a worker, in order, as
    (worker URL, prompt, streaming)."""
    posts: list[tuple[str, list[int], bool]] = []
    client = stack.gateway.workers
    original = client.post

    async def post(url, path, body, *, stream, **kwargs):  # noqa: ANN001, ANN202
        posts.append((url, json.loads(body)["prompt"], stream))
        return await original(url, path, body, stream=stream, **kwargs)

    client.post = post
    return posts


@pytest.mark.timeout(60)
def test_sigstopped_replica_streams_and_completions_move_to_the_other(redis_url, tmp_path):
    """Two replicas, one a fake-backend process. A non-streaming request is held on it
    (token delay) and the process is SIGSTOPped; a stream whose prefix prefers it is sent
    at once. The stream gets no status within first_byte_timeout_s and is retried on the
    other replica; the held completion is retried once the stopped one is unreachable (the
    first-byte timeout, or the load poller, its /load timing out after 1 s) and has been
    silent for worker_lost_after_s (1 s here: no poll answer, no byte on any connection;
    the poller-only path is the hung variant below). Which replica each try went to is
    recorded by wrapping the gateway's worker client, so the test proves both really went
    to the stopped one first. Later requests all go to the live replica at once."""
    first_byte_s = 0.5
    other = FakeBackend(name="small1")
    with (
        backend_proc(log_path=tmp_path / "backend.log") as (stopped_url, proc),
        serving(other) as other_url,
        gateway_over(
            redis_url,
            {"small": [stopped_url, other_url]},
            first_byte_timeout_s=first_byte_s,
            worker_lost_after_s=1.0,
        ) as s,
    ):
        views = s.gateway.pools["small"].views
        wait_until(lambda: all(v.state == "ready" for v in views.values()), 5, "both ready")
        key = s.tenant("stopped", tokens_per_day=BIG, max_concurrent=8)
        minute0 = this_minute()
        posts = record_posts(s)
        urls = [stopped_url, other_url]
        p_json, p_stream = (
            prompt_preferring(stopped_url, urls),
            prompt_preferring(stopped_url, urls, 1),
        )
        httpx.post(f"{stopped_url}/_control", json={"token_delay_s": 0.5})
        bg = Background()
        bg.send(s.url, key, {**BODY, "prompt": p_json, "max_tokens": 8}, timeout_s=20)
        wait_until(lambda: stats(stopped_url)["active"] == 1, 10, "held on the stopped replica")
        os.kill(proc.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        s_result = send(s.url, key, stream_body(prompt=p_stream), timeout_s=20)
        j_result = bg.join(10)[0]
        assert s_result.status == 200 and s_result.done, (s_result.status, s_result.events[-2:])
        assert j_result.status == 200, j_result.body
        assert j_result.body["choices"][0]["text"].startswith("s")
        assert s_result.elapsed_s < first_byte_s + 2.0
        assert time.monotonic() - t_stop < 1.0 + 3.0  # /load timeout + polls + slack
        tries = {tuple(p): [u for u, q, _ in posts if q == p] for p in (p_json, p_stream)}
        assert tries[tuple(p_json)] == [stopped_url, other_url], tries
        assert tries[tuple(p_stream)] == [stopped_url, other_url], (
            "the stream did not go to the stopped replica first (the poller saw it first?)",
            tries,
        )
        assert views[stopped_url].state == "unreachable"
        posts.clear()
        later = [send(s.url, key, b, timeout_s=5) for b in (BODY, stream_body()) * 2]
        for r in later:
            assert r.status == 200 and r.elapsed_s < 1.0, (r.status, r.elapsed_s)
        assert {u for u, _, _ in posts} == {other_url}
        told = s_result.usage + j_result.usage + sum(r.usage for r in later)
        assert_books(s.url, key, told, minute0)


@pytest.mark.timeout(60)
def test_hung_replica_deterministic(redis_url):
    """The in-process variant: one replica in mode "hang" (accepts, never answers).
    A non-streaming request waiting on it is retried on the other replica only once the
    hung one reports `stalled` (via /_control) and the poller marks it lost; then, with it
    reporting ready again, a stream sent to it is retried on the other replica after
    first_byte_timeout_s. Which replica got what is read from the backends' bodies."""
    first_byte_s = 0.5
    with gateway_stack(redis_url, replicas={"small": 2}, first_byte_timeout_s=first_byte_s) as s:
        hung, live = s.backends["small0"], s.backends["small1"]
        urls = [s.backend_urls["small0"], s.backend_urls["small1"]]
        view = s.gateway.pools["small"].views[urls[0]]
        key = s.tenant("hung", tokens_per_day=BIG, max_concurrent=8)
        minute0 = this_minute()
        p_json = prompt_preferring(urls[0], urls)
        p_stream = prompt_preferring(urls[0], urls, 1)
        hung.mode = "hang"

        bg = Background()
        bg.send(s.url, key, {**BODY, "prompt": p_json}, timeout_s=20)
        wait_until(lambda: hung.active == 1, 5, "the completion waits on the hung replica")
        time.sleep(0.3)  # a negative check: several load polls pass, nothing moves it
        assert bg.threads[0].is_alive() and len(live.bodies) == 0
        assert usage(s.url, key)["concurrent_requests"] == 1
        t_stall = time.monotonic()
        hung.state = "stalled"
        j_result = bg.join(5)[0]
        assert j_result.status == 200, j_result.body
        assert time.monotonic() - t_stall < 2.0
        assert [b["prompt"] for b in live.bodies] == [p_json]

        hung.state = "ready"
        wait_until(lambda: view.state == "ready", 5, "the hung replica back in the rotation")
        s_result = send(s.url, key, stream_body(prompt=p_stream), timeout_s=10)
        assert s_result.status == 200 and s_result.done, (s_result.status, s_result.events)
        assert first_byte_s * 0.9 < s_result.elapsed_s < first_byte_s + 2.0
        assert [b["prompt"] for b in hung.bodies] == [p_json, p_stream]
        assert [b["prompt"] for b in live.bodies] == [p_json, p_stream]
        wait_until(lambda: hung.active == 0, 5, "the gateway closed both hung requests")
        assert_books(s.url, key, s_result.usage + j_result.usage, minute0)


# -- 5. Workers refusing, or answering 400 --------------------------------------------------


@pytest.mark.timeout(60)
def test_every_replica_refusing_is_a_real_503_and_a_400_is_relayed_once(redis_url):
    with gateway_stack(redis_url, replicas={"small": 2}) as s:
        b0, b1 = s.backends["small0"], s.backends["small1"]
        key = s.tenant("refused", tokens_per_day=BIG, max_concurrent=4)
        minute0 = this_minute()
        b0.mode = b1.mode = "refuse"
        plain = send(s.url, key, BODY)
        streamed = send(s.url, key, stream_body())
        for r in (plain, streamed):
            assert r.status == 503, (r.status, r.body, r.events)
            assert r.headers["content-type"].startswith("application/json")
            assert r.code == "upstream_unavailable", r.body
            assert int(r.headers["retry-after"]) >= 1
        attempts = s.gateway.config.dispatch_attempts
        assert len(b0.bodies) + len(b1.bodies) == 2 * attempts
        assert b0.bodies and b1.bodies, "retried on the other replica"
        assert_books(s.url, key, 0, minute0)

        b0.mode, b1.mode = "bad_request", "ok"
        b0.bodies.clear()
        b1.bodies.clear()
        urls = [s.backend_urls["small0"], s.backend_urls["small1"]]
        prompt = prompt_preferring(urls[0], urls)
        plain = send(s.url, key, {**BODY, "prompt": prompt})
        streamed = send(s.url, key, stream_body(prompt=prompt))
        for r in (plain, streamed):
            assert r.status == 400, (r.status, r.body, r.events)
            assert r.body["error"]["param"] == "top_k", r.body
        assert len(b0.bodies) == 2
        assert stats(urls[1])["bodies"] == [], "a 400 must not be retried on another replica"
        assert_books(s.url, key, 0, minute0)
