"""Quota faults end to end: Redis restarted mid-traffic, Redis down during reconcile, and a
gateway SIGKILLed between reserve and reconcile. Every test ends by checking the tenant's
books: its Redis counters equal the usage its clients were told, and no slot is left."""

import signal
import threading
import time

import httpx
import pytest

from tests.integration.gateway.conftest import gateway_stack
from tests.integration.gateway.faults_support import (
    BIG,
    BODY,
    PROMPT,
    Background,
    Result,
    assert_books,
    metric,
    send,
    stats,
    stream_body,
    subprocess_config,
    this_minute,
    usage,
    wait_until,
)
from tests.support.redis_server import restartable_redis
from tests.support.servers import gateway_proc

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
