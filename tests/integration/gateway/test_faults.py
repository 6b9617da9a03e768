"""Faults end to end: a real Redis (restarted, stopped), real HTTP over loopback, fake
backends as workers (in-process, or a subprocess that gets SIGSTOPped), and the gateway
in-process or as a subprocess that gets SIGKILLed or SIGTERMed.

Every test ends by checking the tenant's books: its Redis counters (`GET /v1/usage`) equal
the usage its clients were told, and no concurrency slot is left (tenants are created with
`max_concurrent`, so slots are tracked). Conditions are awaited with bounded polls, never
with sleeps that order events.
"""

import json
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from benchmarks.fake_backend import FakeBackend
from gateway.app import create_gateway_app
from gateway.balancer import prefix_key, rendezvous_weight
from gateway.config import GatewayConfig
from gateway.http_server import server_config
from gateway.process import build_gateway
from tests.integration.gateway.conftest import ADMIN, Stack, gateway_stack
from tests.support.redis_server import restartable_redis
from tests.support.servers import backend_proc, gateway_proc, serving, wait_ready
from tests.support.worker import free_port

PROMPT = [5, 6, 7, 8]  # 4 prompt tokens, for the gateway and the fake backend alike
BODY = {"model": "small", "prompt": PROMPT, "max_tokens": 6}
BIG = 10**9  # a limit that is never reached: set so the class is tracked


# -- helpers ------------------------------------------------------------------------------


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.02):
    """Poll `cond` until it returns something truthy (returned), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(every_s)


@dataclass
class Result:
    """One request as its client saw it."""

    status: int
    headers: dict[str, str]
    elapsed_s: float
    body: Any = None  # the JSON of a non-streaming answer (or of a refused stream)
    events: list[Any] = field(default_factory=list)  # a stream's data payloads, "[DONE]" as is
    comments: int = 0  # SSE comment lines (": queued")
    error: str | None = None  # a transport error the client met
    t0: float = 0.0  # time.monotonic() when it was sent

    @property
    def usage(self) -> int:
        """The tokens the client was told it used (0 when not served)."""
        if self.status != 200:
            return 0
        if self.events:
            usage = [e["usage"] for e in self.events if isinstance(e, dict) and e.get("usage")]
            return usage[-1]["total_tokens"] if usage else 0
        return self.body["usage"]["total_tokens"] if self.body else 0

    @property
    def code(self) -> str | None:
        """The OpenAI error code: of the body, or of an in-band error event."""
        if isinstance(self.body, dict) and "error" in self.body:
            return self.body["error"]["code"]
        for e in self.events:
            if isinstance(e, dict) and "error" in e:
                return e["error"]["code"]
        return None

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"


def send(
    base: str,
    key: str,
    body: dict,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
    on_status: Callable[[int], None] | None = None,
) -> Result:
    """POST /v1/completions (streaming when body says so) and read the whole answer."""
    hdrs = {"authorization": f"Bearer {key}", **(headers or {})}
    t0 = time.monotonic()
    result = Result(0, {}, 0.0, t0=t0)
    try:
        with (
            httpx.Client(timeout=timeout_s) as c,
            c.stream("POST", f"{base}/v1/completions", json=body, headers=hdrs) as r,
        ):
            result.status, result.headers = r.status_code, dict(r.headers)
            if on_status is not None:
                on_status(r.status_code)
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                for line in r.iter_lines():
                    if line.startswith(":"):
                        result.comments += 1
                    elif line.startswith("data: "):
                        data = line[6:]
                        result.events.append(data if data == "[DONE]" else json.loads(data))
            else:
                raw = r.read()
                try:
                    result.body = json.loads(raw)
                except ValueError:
                    result.body = raw.decode(errors="replace")
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    result.elapsed_s = time.monotonic() - t0
    return result


def stream_body(**extra) -> dict:
    return {**BODY, "stream": True, "stream_options": {"include_usage": True}, **extra}


class Background:
    """Requests sent from threads; `results` in completion order."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.results: list[Result] = []
        self.statuses: list[int] = []  # response statuses as they arrive (before bodies)

    def send(self, *args, **kwargs) -> None:
        def run() -> None:
            self.results.append(send(*args, on_status=self.statuses.append, **kwargs))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout_s: float) -> list[Result]:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = sum(t.is_alive() for t in self.threads)
        assert alive == 0, f"{alive} requests still running after {timeout_s} s"
        return self.results


def usage(base: str, key: str) -> dict:
    r = httpx.get(f"{base}/v1/usage", headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def assert_books(base: str, key: str, told: int, minute0: int, timeout_s: float = 5.0) -> float:
    """Wait until the tenant's counters show exactly `told` tokens and no slot is held;
    returns how long that took. `minute0`: the minute the tenant's traffic began (the
    minute window is only compared when no minute boundary passed since)."""
    t0 = time.monotonic()
    last: dict = {}

    def settled() -> bool:
        nonlocal last
        last = usage(base, key)
        same_minute = int(time.time() // 60) == minute0
        return (
            last["tokens_today"] == told
            and last["concurrent_requests"] == 0
            and (last["tokens_this_minute"] == told or not same_minute)
        )

    try:
        wait_until(settled, timeout_s, "books settle", every_s=0.05)
    except AssertionError:
        raise AssertionError(f"counters {last} != told {told} tokens, 0 slots") from None
    return time.monotonic() - t0


def this_minute() -> int:
    return int(time.time() // 60)


def prompt_preferring(target: str, urls: list[str], skip: int = 0) -> list[int]:
    """A 4-token prompt whose rendezvous winner among `urls` is `target` (the gateway
    sends it there while that replica is not much busier than the others)."""
    found = 0
    for i in range(1, 10_000):
        prompt = [i, i + 1, i + 2, i + 3]
        aff = prefix_key(prompt)
        if max(urls, key=lambda u: rendezvous_weight(aff, u.rstrip("/"))) == target:
            if found == skip:
                return prompt
            found += 1
    raise AssertionError("no prompt found")


def metric(base: str, name: str, labels: str = "") -> float:
    """The value of one sample of the gateway's /metrics (0 when absent)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + (labels or " ")) or line.startswith(name + "{" + labels):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def stats(url: str) -> dict:
    return httpx.get(f"{url}/_stats", timeout=5).json()


@contextmanager
def gateway_over(redis_url: str, pools: dict[str, list[str]], *, server=None, **config):
    """An in-process gateway over these worker URLs (fresh Redis db); `server`: kwargs of
    `gateway.http_server.server_config` to serve it as the gateway process does."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    with ExitStack() as stack:
        cfg = GatewayConfig(
            pools=pools,
            data_dir=stack.enter_context(tempfile.TemporaryDirectory(prefix="sy-gw-")),
            admin_key=ADMIN,
            load_poll_interval_s=0.05,
            **config,
        )
        gw = build_gateway(cfg, redis_url)
        app = create_gateway_app(gw)
        if server is not None:
            app = server_config(app, "127.0.0.1", free_port(), **server)
        url = stack.enter_context(serving(app))
        wait_ready(url, 10)
        yield Stack(url, {}, {}, redis_url, gw)


def subprocess_config(stack: Stack, data_dir, **extra) -> dict:
    """A `gateway:` config for a gateway process over `stack`'s Redis and backends."""
    pools: dict[str, list[str]] = {}
    for name, url in stack.backend_urls.items():
        pools.setdefault(name.rstrip("0123456789"), []).append(url)
    return {
        "pools": pools,
        "redis_url": stack.redis_url,
        "admin_key": ADMIN,
        "data_dir": str(data_dir),
        "load_poll_interval_s": 0.05,
        **extra,
    }


# -- 1. Redis restart mid-traffic ---------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["open", "closed"])
def test_redis_restart_mid_traffic_heals_at_once_and_charges_every_answer(policy):
    """Steady traffic, alternating streaming and not, while Redis restarts (same socket,
    same data). Asserted: requests sent while Redis answers are all 200 *and* checked
    (x-ratelimit headers come only from reserve.lua), including the very first one sent
    after the restart; during the outage the failure policy decides (open: 200 served
    unchecked; closed: 503 quota_unavailable with Retry-After); never auth_unavailable
    (the key is known). Afterwards the counters equal the usage every client was told:
    unchecked requests are charged from the journal once Redis is back."""
    sweep_s = 0.1
    with (
        restartable_redis() as rr,
        gateway_stack(
            rr.unix_url,
            replicas={"small": 1},
            quota_sweep_interval_s=sweep_s,
            fail_tokens=policy,
            fail_requests=policy,
            fail_concurrency=policy,
        ) as s,
    ):
        key = s.tenant("restart", tokens_per_day=BIG, requests_per_minute=BIG, max_concurrent=4)
        minute0 = this_minute()
        results: list[Result] = []
        stop = threading.Event()

        def traffic() -> None:
            i = 0
            while not stop.is_set():
                body = stream_body() if i % 2 else BODY
                results.append(send(s.url, key, body, timeout_s=15))
                i += 1

        client = threading.Thread(target=traffic, daemon=True)
        client.start()
        try:
            wait_until(lambda: len(results) >= 4, 10, "traffic before the outage")
            t_stopping = time.monotonic()
            rr.stop()
            t_down = time.monotonic()  # redis-server has exited
            wait_until(
                lambda: sum(r.t0 > t_down for r in results) >= 3, 15, "requests in the outage"
            )
            t_starting = time.monotonic()
            rr.start()
            t_up = time.monotonic()  # redis-server answers PING
            wait_until(lambda: sum(r.t0 > t_up for r in results) >= 6, 15, "requests after")
        finally:
            stop.set()
            client.join(20)
        assert not client.is_alive()

        for r in results:
            assert r.error is None, r.error
            assert r.code != "auth_unavailable", r.body
        before = [r for r in results if r.t0 + r.elapsed_s < t_stopping]
        after = [r for r in results if r.t0 > t_up]
        during = [r for r in results if r.t0 > t_down and r.t0 + r.elapsed_s < t_starting]
        for r in before + after:
            assert r.status == 200, (r.status, r.body)
            assert "x-ratelimit-limit-requests" in r.headers, "served unchecked with Redis up"
        assert during, "no request fell inside the outage"
        for r in during:
            if policy == "open":
                assert r.status == 200 and "x-ratelimit-limit-requests" not in r.headers
            else:
                assert r.status == 503 and r.code == "quota_unavailable", (r.status, r.body)
                assert int(r.headers["retry-after"]) >= 1
        for r in results:
            if r.status == 200 and r.events:
                assert r.done, r.events[-2:]
        told = sum(r.usage for r in results)
        assert told > 0
        assert_books(s.url, key, told, minute0, timeout_s=10 * sweep_s + 3)
        assert metric(s.url, "switchyard_gateway_quota_journal_outstanding") == 0


# -- 2. Redis down during reconcile -------------------------------------------------------


@pytest.mark.timeout(60)
def test_redis_down_during_reconcile_is_settled_from_the_journal():
    """N requests are admitted and held by the worker; Redis stops; they finish (their
    reconciles journaled); Redis comes back; within a few sweeps the counters equal the
    usage told and the slots are free."""
    sweep_s = 0.2
    with (
        restartable_redis() as rr,
        gateway_stack(rr.unix_url, replicas={"small": 1}, quota_sweep_interval_s=sweep_s) as s,
    ):
        backend, burl = s.backends["small0"], s.backend_urls["small0"]
        key = s.tenant("journal", tokens_per_day=BIG, max_concurrent=8)
        minute0 = this_minute()
        backend.token_delay_s = 0.2
        bg = Background()
        for _ in range(3):
            bg.send(s.url, key, stream_body(max_tokens=20), timeout_s=30)
        bg.send(s.url, key, {**BODY, "max_tokens": 12}, timeout_s=30)  # held 12 x 0.2 s
        wait_until(lambda: stats(burl)["active"] == 4, 10, "all 4 in flight on the worker")
        assert usage(s.url, key)["concurrent_requests"] == 4
        rr.stop()
        backend.token_delay_s = 0.0  # the streams finish at their next token
        results = bg.join(20)
        assert [r.status for r in results] == [200] * 4, [(r.status, r.body) for r in results]
        assert all(r.done for r in results if r.events)
        wait_until(  # reconciles run just after the answers
            lambda: (
                metric(s.url, "switchyard_gateway_quota_journaled_total", 'kind="checked"') == 4
            ),
            5,
            "the 4 reconciles met a stopped Redis and were journaled",
        )
        assert (
            httpx.get(f"{s.url}/v1/usage", headers={"authorization": f"Bearer {key}"}).status_code
            == 503
        )
        rr.start()
        took = assert_books(s.url, key, sum(r.usage for r in results), minute0, 5 * sweep_s + 3)
        assert took < 5 * sweep_s + 3
        assert metric(s.url, "switchyard_gateway_quota_journal_outstanding") == 0


# -- 3. Gateway SIGKILLed between reserve and reconcile ------------------------------------


@pytest.mark.timeout(90)
def test_sigkilled_gateway_slots_are_freed_by_a_live_one_within_the_heartbeat(redis_url, tmp_path):
    """Gateway A (a process) admits 3 streams to a slow worker and is SIGKILLed; gateway B
    (in-process, same Redis, another data dir) frees A's slots within heartbeat TTL + sweep
    interval, the killed requests stay charged what they reserved (the documented rule),
    and the worker sees the streams aborted."""
    ttl_s, sweep_s = 1.0, 0.2
    with gateway_stack(
        redis_url,
        replicas={"small": 1},
        quota_heartbeat_ttl_s=ttl_s,
        quota_sweep_interval_s=sweep_s,
    ) as b:
        backend = b.backends["small0"]
        key = b.tenant("killed", tokens_per_day=BIG, max_concurrent=8)
        minute0 = this_minute()
        cfg = subprocess_config(
            b, tmp_path / "a", quota_heartbeat_ttl_s=ttl_s, quota_sweep_interval_s=sweep_s
        )
        with gateway_proc(cfg, tmp_path) as (a_url, a_proc):
            first = send(a_url, key, BODY)  # one that completes through A
            assert first.status == 200, first.body
            backend.token_delay_s = 0.2
            bg = Background()
            for _ in range(3):
                bg.send(a_url, key, stream_body(max_tokens=50), timeout_s=30)
            wait_until(lambda: backend.active == 3, 10, "3 streams in flight")
            assert usage(b.url, key)["concurrent_requests"] == 3
            aborted = backend.aborted
            a_proc.send_signal(signal.SIGKILL)
            a_proc.wait(10)
            t_kill = time.monotonic()
        results = bg.join(10)
        assert all(r.status == 200 and not r.done for r in results), "streams were cut"
        wait_until(lambda: backend.aborted == aborted + 3, 5, "the worker saw 3 aborts")
        assert backend.active == 0
        reserved = 3 * (len(PROMPT) + 50)
        assert_books(b.url, key, first.usage + reserved, minute0, timeout_s=ttl_s + 10 * sweep_s)
        freed_after = time.monotonic() - t_kill
        assert freed_after < ttl_s + 10 * sweep_s  # seconds, not the 10-minute lease
        assert metric(b.url, "switchyard_gateway_quota_swept_total") == 3


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
    other replica, which marks the stopped one unreachable; the held completion is retried
    then (or when the load poller marks it, its /load timing out after 1 s: whichever is
    first; the poller-only path is the hung variant below). Which replica each try went to is
    recorded by wrapping the gateway's worker client, so the test proves both really went
    to the stopped one first. Later requests all go to the live replica at once."""
    first_byte_s = 0.5
    other = FakeBackend(name="small1")
    with (
        backend_proc(log_path=tmp_path / "backend.log") as (stopped_url, proc),
        serving(other) as other_url,
        gateway_over(
            redis_url, {"small": [stopped_url, other_url]}, first_byte_timeout_s=first_byte_s
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


# -- 6. Bounded shutdown ------------------------------------------------------------------

SHUTDOWN_STREAMS = 6


@dataclass
class Shutdown:
    exited_after_s: float
    returncode: int
    streams: list[Result]
    completion: Result
    freed_after_s: float  # SIGTERM to no slot left (by A's reconciles or B's sweep)
    usage: dict  # the tenant's counters then
    swept: float  # reservations of A that B had to sweep


@pytest.fixture(scope="module")
def shutdown(redis_url, tmp_path_factory) -> Shutdown:
    """Gateway A, a process with shutdown_grace_s 1, holds SHUTDOWN_STREAMS committed
    streams and one completion on a worker that never answers, and gets SIGTERM. Gateway B
    (in-process, same Redis, heartbeat TTL 1 s on both) reads the books afterwards."""
    tmp = tmp_path_factory.mktemp("shutdown")
    with gateway_stack(
        redis_url, replicas={"small": 1}, quota_heartbeat_ttl_s=1, quota_sweep_interval_s=0.2
    ) as b:
        backend = b.backends["small0"]
        key = b.tenant("shutdown", tokens_per_day=BIG, max_concurrent=SHUTDOWN_STREAMS + 1)
        cfg = subprocess_config(
            b,
            tmp / "a",
            shutdown_grace_s=1,
            sse_heartbeat_s=0.2,
            first_byte_timeout_s=60,
            stream_idle_timeout_s=60,
            quota_heartbeat_ttl_s=1,
        )
        with gateway_proc(cfg, tmp) as (a_url, a_proc):
            backend.mode = "hang"
            bg = Background()
            for _ in range(SHUTDOWN_STREAMS):
                bg.send(a_url, key, stream_body(), timeout_s=30)
            bg.send(a_url, key, BODY, timeout_s=30)
            n = SHUTDOWN_STREAMS + 1
            wait_until(lambda: backend.active == n, 10, f"{n} requests hang on the worker")
            wait_until(
                lambda: bg.statuses.count(200) == SHUTDOWN_STREAMS, 5, "the streams committed"
            )
            a_proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            a_proc.wait(15)
            exited_after = time.monotonic() - t0
        results = bg.join(5)
        wait_until(lambda: backend.active == 0, 5, "the worker saw every request abandoned")
        wait_until(lambda: usage(b.url, key)["concurrent_requests"] == 0, 5, "A's slots freed")
        return Shutdown(
            exited_after_s=exited_after,
            returncode=a_proc.returncode,
            streams=[r for r in results if r.events or r.comments],
            completion=next(r for r in results if not (r.events or r.comments)),
            freed_after_s=time.monotonic() - t0,
            usage=usage(b.url, key),
            swept=metric(b.url, "switchyard_gateway_quota_swept_total"),
        )


@pytest.mark.timeout(60)
def test_sigterm_with_hanging_requests_exits_within_the_grace_and_frees_slots(shutdown):
    """SIGTERM: the process exits within a few seconds of the 1 s grace, every client's
    connection ends, the worker sees its requests abandoned (checked in the fixture), no
    slot is left, and each request is charged either nothing or at most its reservation."""
    # uvicorn re-raises the signal it handled once it has shut down
    assert shutdown.returncode in (0, -signal.SIGTERM), shutdown.returncode
    assert shutdown.exited_after_s < 1 + 3.0, shutdown.exited_after_s
    assert len(shutdown.streams) == SHUTDOWN_STREAMS
    assert all(r.status == 200 for r in shutdown.streams)
    assert shutdown.usage["concurrent_requests"] == 0
    reserved = (SHUTDOWN_STREAMS + 1) * (len(PROMPT) + BODY["max_tokens"])
    assert shutdown.usage["tokens_today"] <= reserved


def test_sigterm_answers_requests_cut_by_the_grace_in_the_openai_shape(shutdown):
    c = shutdown.completion
    assert c.status == 503 and isinstance(c.body, dict), (c.status, c.body)
    assert c.body["error"]["type"] and "retry-after" in c.headers
    for r in shutdown.streams:
        assert r.error is None and r.done and r.code is not None, (r.error, r.events)


def test_sigterm_settles_its_own_cancelled_requests_charging_nothing(shutdown):
    assert shutdown.swept == 0, f"{shutdown.swept:g} reservations left for another gateway"
    assert shutdown.usage["tokens_today"] == 0, shutdown.usage


# -- 7. Slow clients ------------------------------------------------------------------------

HEADER_S, KEEP_ALIVE_S, BODY_S = 2.0, 1.0, 0.5


@pytest.fixture
def bounded(redis_url):
    """An in-process gateway served as the gateway process serves it (head, keep-alive and
    body timeouts), over one fake backend."""
    with (
        serving(FakeBackend(name="small0")) as b,
        gateway_over(
            redis_url,
            {"small": [b]},
            body_timeout_s=BODY_S,
            server={
                "header_timeout_s": HEADER_S,
                "keep_alive_timeout_s": KEEP_ALIVE_S,
                "shutdown_grace_s": 1,
            },
        ) as s,
    ):
        yield s


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _closed_after(sock: socket.socket, t0: float, limit_s: float) -> float:
    """Seconds from `t0` until the peer closes `sock` (reading and discarding)."""
    sock.settimeout(limit_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


@pytest.mark.timeout(30)
def test_partial_request_head_is_closed_after_header_timeout(bounded):
    with _connect(bounded.url) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        took = _closed_after(sock, t0, HEADER_S + 5)
    assert HEADER_S * 0.9 < took < HEADER_S + 1.5, took


@pytest.mark.timeout(30)
def test_head_trickled_byte_by_byte_is_closed_after_header_timeout(bounded):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4000
    with _connect(bounded.url) as sock:
        sock.settimeout(0.1)
        t0 = time.monotonic()
        closed_after = None
        for i in range(len(head)):
            try:
                sock.sendall(head[i : i + 1])
                if sock.recv(1) == b"":
                    closed_after = time.monotonic() - t0
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed_after = time.monotonic() - t0
                break
            if time.monotonic() - t0 > HEADER_S + 5:
                break
    assert closed_after is not None and closed_after < HEADER_S + 1.5, closed_after


@pytest.mark.timeout(30)
def test_partial_body_gets_408_after_body_timeout_and_charges_nothing(bounded):
    key = bounded.tenant("slowbody", tokens_per_day=BIG, max_concurrent=2)
    minute0 = this_minute()
    body = json.dumps(BODY).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with _connect(bounded.url) as sock:
        t0 = time.monotonic()
        sock.sendall(head + body[:10])
        sock.settimeout(BODY_S + 5)
        raw = b""
        while b"\r\n\r\n" not in raw:
            chunk = sock.recv(4096)
            assert chunk, f"closed without an answer: {raw!r}"
            raw += chunk
        took = time.monotonic() - t0
        status_line, rest = raw.split(b"\r\n", 1)
        headers, payload = rest.split(b"\r\n\r\n", 1)
        length = int(
            next(
                h.split(b":")[1]
                for h in headers.split(b"\r\n")
                if h.lower().startswith(b"content-length")
            )
        )
        while len(payload) < length:
            payload += sock.recv(4096)
    assert status_line.startswith(b"HTTP/1.1 408"), status_line
    err = json.loads(payload)["error"]
    assert err["code"] == "timeout" and err["message"] and "type" in err and "param" in err
    assert BODY_S * 0.9 < took < BODY_S + 1.5, took
    assert_books(bounded.url, key, 0, minute0)


@pytest.mark.timeout(30)
def test_idle_keep_alive_connection_is_closed_after_keep_alive_timeout(bounded):
    with _connect(bounded.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = b""
        while not raw.endswith(b"}"):  # {"status":"ok"}
            chunk = sock.recv(4096)
            assert chunk, raw
            raw += chunk
        t0 = time.monotonic()
        assert raw.startswith(b"HTTP/1.1 200")
        took = _closed_after(sock, t0, HEADER_S + 5)
    # Closed by the keep-alive timer, before the (longer) head timer would have.
    assert KEEP_ALIVE_S * 0.8 < took < HEADER_S * 0.95, took


# -- 8. The client's deadline --------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("heartbeat_s", [0.3, 5.0], ids=["committed", "uncommitted"])
def test_client_deadline_on_a_hung_worker_answers_in_time(redis_url, heartbeat_s):
    """`x-request-timeout: 1` to a worker that never answers: a non-streaming request gets
    408 request_timeout (the client's own budget ran out; no Retry-After) within ~2 s; a
    stream gets an in-band request_timeout error (committed after one heartbeat) or a real
    408 (deadline before the first heartbeat). Nothing is charged and the slot is free; the
    worker sees the requests abandoned."""
    with gateway_stack(redis_url, replicas={"small": 1}, sse_heartbeat_s=heartbeat_s) as s:
        backend = s.backends["small0"]
        key = s.tenant("deadline", tokens_per_day=BIG, max_concurrent=4)
        minute0 = this_minute()
        backend.mode = "hang"
        deadline = {"x-request-timeout": "1"}
        plain = send(s.url, key, BODY, headers=deadline, timeout_s=10)
        assert plain.status == 408 and plain.code == "request_timeout", (plain.status, plain.body)
        assert "retry-after" not in plain.headers
        streamed = send(s.url, key, stream_body(), headers=deadline, timeout_s=10)
        if heartbeat_s < 1:
            assert streamed.status == 200 and streamed.comments >= 1
            assert streamed.code == "request_timeout" and streamed.done, streamed.events
        else:
            assert streamed.status == 408 and streamed.code == "request_timeout"
        for r in (plain, streamed):
            assert 0.9 < r.elapsed_s < 2.0, r.elapsed_s
        wait_until(lambda: backend.active == 0, 5, "the worker saw both abandoned")
        assert_books(s.url, key, 0, minute0)


@pytest.mark.timeout(30)
def test_invalid_deadline_headers_are_400_and_charge_nothing(stack):
    key = stack.tenant("baddeadline", tokens_per_day=BIG, max_concurrent=4)
    for value in ["nan", "-1", "0", "inf", "-inf", "1e999", "abc", ""]:
        for body in (BODY, stream_body()):
            r = send(stack.url, key, body, headers={"x-request-timeout": value}, timeout_s=5)
            assert r.status == 400, (value, r.status, r.body)
            assert r.body["error"]["param"] == "x-request-timeout", r.body
    assert len(stack.backends["small0"].bodies) == 0
    u = usage(stack.url, key)
    assert (u["tokens_today"], u["requests_this_minute"], u["concurrent_requests"]) == (0, 0, 0)
