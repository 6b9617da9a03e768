"""The gateway with several replicas, several gateway processes, a Redis outage, a real
worker behind it, and the admin CLI."""

import asyncio
import json
import os
import signal
import time
from contextlib import ExitStack

import httpx
import pytest

from benchmarks.fake_backend import FakeBackend
from cli.main import main as cli_main
from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.runtime.embedded_redis import EmbeddedRedis
from gateway.runtime.main import build_gateway
from quota.apikeys import format_key, new_key_id, new_secret
from tests.integration.gateway.conftest import ADMIN, Stack, gateway_stack
from tests.support.servers import gateway_process, serving
from tests.support.waiting import eventually
from tests.support.worker import free_port, running_worker

BODY = {"model": "small", "prompt": [5, 6, 7, 8], "max_tokens": 6}


def chat(system: str) -> dict:
    return {
        "model": "small",
        "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
    }


def test_shared_system_prompt_sticks_to_one_replica(redis_url):
    with gateway_stack(redis_url, replicas={"small": 3}) as s:
        key = s.tenant("aff")
        with s.client(key) as c:
            for _ in range(6):
                assert (
                    c.post("/v1/chat/completions", json=chat("You are a pirate. " * 20)).status_code
                    == 200
                )
        served = [b.total for name, b in s.backends.items()]
        assert sorted(served) == [0, 0, 6]


def test_draining_and_unreachable_workers_leave_the_rotation(redis_url):
    with gateway_stack(redis_url, replicas={"small": 2}) as s:
        s.backends["small0"].state = "draining"
        views = s.gateway.pools["small"].views.values()
        assert eventually(lambda: sorted(v.state for v in views) == ["draining", "ready"])
        key = s.tenant("drain")
        with s.client(key) as c:
            assert all(c.post("/v1/completions", json=BODY).status_code == 200 for _ in range(5))
        assert s.backends["small0"].total == 0 and s.backends["small1"].total == 5
        with s.admin() as a:
            fleet = a.get("/admin/fleet").json()["small"]["workers"]
        assert {w["state"] for w in fleet} == {"draining", "ready"}


def test_heartbeat_comments_while_a_stream_waits_in_the_queue(redis_url):
    with gateway_stack(redis_url, max_inflight_per_worker=1, sse_heartbeat_s=0.05) as s:
        s.backends["small0"].token_delay_s = 0.05
        key = s.tenant("hb")
        with (
            s.client(key) as c,
            c.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 10, "stream": True}),
        ):
            with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as second:
                lines = list(second.iter_lines())
        assert ": queued" in lines
        assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines


def test_redis_outage_fail_open_serves_known_keys_and_refuses_unknown_ones():
    from tests.support.redis_server import embedded_redis

    with embedded_redis() as url:
        with gateway_stack(url) as s:
            key = s.tenant("outage", tokens_per_minute=1000)
            with s.client(key) as c:
                assert c.post("/v1/completions", json=BODY).status_code == 200
            _kill_redis(url)
            with s.client(key) as c:
                r = c.post("/v1/completions", json=BODY)
            assert r.status_code == 200, r.text  # tokens fail open by default
            r = httpx.post(
                f"{s.url}/v1/completions",
                json=BODY,
                headers={"authorization": f"Bearer {format_key(new_key_id(), new_secret())}"},
            )
            assert r.status_code == 503 and "retry-after" in r.headers
            metrics = httpx.get(f"{s.url}/metrics").text
            assert 'switchyard_gateway_quota_redis_errors_total{decision="open"' in metrics


def test_redis_outage_fail_closed_is_503_with_retry_after():
    from tests.support.redis_server import embedded_redis

    with embedded_redis() as url:
        with gateway_stack(url, fail_tokens="closed") as s:
            key = s.tenant("closed", tokens_per_minute=1000)
            with s.client(key) as c:
                assert c.post("/v1/completions", json=BODY).status_code == 200
                _kill_redis(url)
                r = c.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "quota_unavailable"
            assert s.backends["small0"].total == 1


def _kill_redis(url: str) -> None:
    import redis

    pid = redis.Redis.from_url(url).info("server")["process_id"]
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.1)


def test_tenants_and_keys_survive_a_gateway_restart_on_embedded_redis(tmp_path):
    backend = FakeBackend()
    with serving(backend) as b:
        cfg = GatewayConfig(pools={"small": [b]}, admin_key=ADMIN, load_poll_interval_s=0.05)
        for round_ in range(2):
            embedded = EmbeddedRedis(tmp_path / "redis")
            try:
                with serving(create_gateway_app(build_gateway(cfg, embedded.url))) as url:
                    s = Stack(url, {"small0": backend}, {}, embedded.url)
                    if round_ == 0:
                        key = s.tenant("persist")
                    time.sleep(0.2)
                    with s.client(key) as c:
                        assert c.post("/v1/completions", json=BODY).status_code == 200
            finally:
                embedded.close()


def test_admin_cli_creates_a_tenant_and_a_key(stack, capsys):
    base = ["admin", "--url", stack.url, "--admin-key", ADMIN]
    assert cli_main([*base, "create-tenant", "cli-t", "--tokens-per-minute", "500"]) == 0
    assert cli_main([*base, "create-key", "cli-t"]) == 0
    out = capsys.readouterr().out
    key = json.loads(out[out.index("{", out.index("}") + 1) :])["key"]
    with stack.client(key) as c:
        r = c.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-tokens"] == "500"


def test_gateway_in_front_of_a_real_worker(redis_url, demo_dir):
    with running_worker(demo_dir) as w, gateway_stack(redis_url) as s:
        s.backends.clear()
        cfg = GatewayConfig(pools={"small": [w.url]}, admin_key=ADMIN, load_poll_interval_s=0.05)
        with serving(create_gateway_app(build_gateway(cfg, redis_url))) as url:
            real = Stack(url, {}, {}, redis_url)
            key = real.tenant("real")
            with real.client(key) as c:
                r = c.post(
                    "/v1/completions",
                    json={
                        "model": "small",
                        "prompt": "Hello",
                        "max_tokens": 5,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 5
                stream_body = {
                    "model": "small",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "ignore_eos": True,
                }
                with c.stream("POST", "/v1/chat/completions", json=stream_body) as st:
                    events = [x[6:] for x in st.iter_lines() if x.startswith("data: ")]
            assert events[-1] == "[DONE]"
            stream_usage = json.loads(events[-2])["usage"]
            assert stream_usage["completion_tokens"] == 4
            expected = r.json()["usage"]["total_tokens"] + stream_usage["total_tokens"]
            deadline = time.monotonic() + 3
            while real.charged("real") != expected and time.monotonic() < deadline:
                time.sleep(0.05)
            assert real.charged("real") == expected


@pytest.mark.timeout(120)
def test_two_gateway_processes_never_admit_more_than_the_limit(redis_url, tmp_path):
    backend = FakeBackend()
    limit, cost = 1000, 4 + 6
    with serving(backend) as b:
        ports = [free_port(), free_port()]
        cfg = {
            "gateway": {
                "pools": {"small": [b]},
                "redis_url": redis_url,
                "admin_key": ADMIN,
                "max_inflight_per_worker": 512,
                "queue_max_requests": 4096,
            }
        }
        with ExitStack() as procs:
            urls = [
                procs.enter_context(gateway_process(cfg["gateway"], tmp_path, p)) for p in ports
            ]
            s = Stack(urls[0], {}, {}, redis_url)
            # The day budget: the same all-or-nothing script as the minute window, without a
            # window rolling over in the middle of the burst.
            key = s.tenant("race", tokens_per_day=limit)
            codes = asyncio.run(_burst(urls, key, 300))
            # Reconciles run after the responses: wait until the day's counter is settled.
            settled = limit // cost * cost
            eventually(lambda: s.usage(key)["tokens_today"] == settled)
            usage = s.usage(key)
    assert codes.count(200) == limit // cost
    assert codes.count(429) == 300 - limit // cost
    assert backend.total == limit // cost
    assert usage["tokens_today"] == limit // cost * cost


async def _burst(urls: list[str], key: str, n: int) -> list[int]:
    limits = httpx.Limits(max_connections=400)
    async with httpx.AsyncClient(
        timeout=60, limits=limits, headers={"authorization": f"Bearer {key}"}
    ) as c:
        rs = await asyncio.gather(
            *(c.post(f"{urls[i % 2]}/v1/completions", json=BODY) for i in range(n))
        )
    return [r.status_code for r in rs]
