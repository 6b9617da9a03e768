"""A pool with no live replica, end to end: with every replica unreachable a request (no
`x-request-timeout`, so a 120 s deadline) is refused at once with a real 503 and a
Retry-After, streaming or not, charged nothing; requests already queued when the last
replica dies are refused at the next load poll; and a replica that is still starting (not
listening yet) is waited for, not refused."""

import signal
import tempfile
import time
from contextlib import ExitStack, contextmanager

import pytest

from benchmarks.fake_backend import FakeBackend
from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.runtime.main import build_gateway
from tests.integration.gateway.conftest import ADMIN, Stack
from tests.integration.gateway.faults_support import (
    BIG,
    BODY,
    Background,
    assert_books,
    gateway_over,
    send,
    stream_body,
    this_minute,
    wait_until,
)
from tests.support.servers import backend_proc, serving, wait_ready
from tests.support.worker import free_port

REFUSED_WITHIN_S = 5.0  # far below the 120 s default deadline the request would wait out


@pytest.mark.timeout(60)
def test_with_every_replica_unreachable_a_request_is_refused_at_once(redis_url):
    with ExitStack() as backends:
        urls = [backends.enter_context(serving(FakeBackend(name=f"b{i}"))) for i in range(2)]
        with gateway_over(redis_url, {"small": urls}) as s:
            views = s.gateway.pools["small"].views.values()
            key = s.tenant("dead", tokens_per_day=BIG, max_concurrent=4)
            minute0 = this_minute()
            assert send(s.url, key, BODY).status == 200
            served = 6 + 4  # the fake backend's usage: max_tokens + the 4-token prompt
            backends.close()  # both replicas stop listening
            wait_until(lambda: all(v.state == "unreachable" for v in views), 10, "both lost")
            plain = send(s.url, key, BODY, timeout_s=30)
            streamed = send(s.url, key, stream_body(), timeout_s=30)
            for r in (plain, streamed):
                assert r.status == 503, (r.status, r.body, r.events, r.error)
                assert r.elapsed_s < REFUSED_WITHIN_S, r.elapsed_s
                assert r.headers["content-type"].startswith("application/json")
                assert r.code == "upstream_unavailable", r.body
                assert int(r.headers["retry-after"]) >= 1
            assert_books(s.url, key, served, minute0)


@pytest.mark.timeout(60)
def test_requests_queued_when_the_last_replica_dies_are_refused_at_the_next_poll(
    redis_url, tmp_path
):
    with (
        backend_proc(token_delay_s=0.5, log_path=tmp_path / "backend.log") as (url, proc),
        gateway_over(redis_url, {"small": [url]}, max_inflight_per_worker=1) as s,
    ):
        pool = s.gateway.pools["small"]
        key = s.tenant("queued", tokens_per_day=BIG, max_concurrent=8)
        holder, queued = Background(), Background()
        holder.send(s.url, key, {**BODY, "max_tokens": 40}, timeout_s=40)  # the one slot
        wait_until(lambda: pool.controller.num_dispatched == 1, 10, "the first is dispatched")
        for i in range(2):
            queued.send(s.url, key, {**BODY, "user": f"queued-{i}"}, timeout_s=40)
        wait_until(lambda: len(pool.queue) == 2, 10, "two requests wait in the queue")
        proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for r in queued.join(30):
            assert r.status == 503 and r.code == "upstream_unavailable", (r.status, r.body, r.error)
            assert r.t0 + r.elapsed_s - killed_at < REFUSED_WITHIN_S
            assert int(r.headers["retry-after"]) >= 1
        (first,) = holder.join(30)
        assert first.status in (502, 503), (first.status, first.body, first.error)
        wait_until(lambda: pool.controller.num_dispatched == 0, 5, "every slot given back")
        assert len(pool.queue) == 0


@contextmanager
def gateway_before_its_replica(redis_url: str, url: str, **config):
    """A gateway over a replica URL nothing listens on yet (not waiting for /ready)."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    with tempfile.TemporaryDirectory(prefix="sy-gw-") as data_dir:
        cfg = GatewayConfig(
            pools={"small": [url]},
            data_dir=data_dir,
            admin_key=ADMIN,
            load_poll_interval_s=0.05,
            **config,
        )
        gw = build_gateway(cfg, redis_url)
        with serving(create_gateway_app(gw)) as gw_url:
            wait_ready(gw_url, 10, path="/health")
            yield Stack(gw_url, {}, {}, redis_url, gw)


@pytest.mark.timeout(60)
def test_a_replica_still_starting_is_waited_for_and_one_silent_past_the_grace_is_not(
    redis_url,
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with gateway_before_its_replica(redis_url, url, replica_start_grace_s=30.0) as s:
        view = s.gateway.pools["small"].views[url]
        key = s.tenant("early", tokens_per_day=BIG)
        wait_until(lambda: view.state == "unreachable", 10, "polled: nothing listens yet")
        bg = Background()
        bg.send(s.url, key, BODY, timeout_s=30)
        wait_until(lambda: len(s.gateway.pools["small"].queue) == 1, 10, "it waits")
        with serving(FakeBackend(), port=port):
            (answer,) = bg.join(20)
        assert answer.status == 200, (answer.status, answer.body)

    with gateway_before_its_replica(redis_url, url, replica_start_grace_s=0.2) as s:
        view = s.gateway.pools["small"].views[url]
        key = s.tenant("late", tokens_per_day=BIG)
        pool = s.gateway.pools["small"]
        wait_until(lambda: not pool.has_live_replica(), 10, "silent past the grace")
        r = send(s.url, key, BODY, timeout_s=30)
        assert r.status == 503 and r.elapsed_s < REFUSED_WITHIN_S, (r.status, r.elapsed_s)
        assert int(r.headers["retry-after"]) >= 1
