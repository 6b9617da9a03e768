"""Streams that outlive their replica, with real worker processes behind a real gateway:
a worker SIGKILLed (or SIGSTOPped) mid-stream hands the stream to the other replica, and
the client's text equals the uninterrupted answer's, byte for byte, greedy and seeded,
with one usage and one charge; the access line and /metrics say it resumed."""

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile

import httpx
import pytest
import redis

from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.runtime.main import build_gateway
from tests.support.quota_books import tokens_charged
from tests.support.redis_server import redis_url as start_redis
from tests.support.servers import serving, wait_ready
from tests.support.waiting import eventually
from tests.support.worker import free_port

ADMIN = "admin-resume"
MAX_TOKENS = 60
CUT_AFTER = 5  # tokens the client reads before its worker is stopped


class Workers:
    """Two `switchyard worker` processes of the model, one pool's replicas. The SIGSTOP
    test runs first and wakes its worker after; the SIGKILL test leaves one."""

    def __init__(self, model_dir, tmp) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        config = os.path.join(tmp, "worker.yaml")
        with open(config, "w") as f:  # no start-up calibration: it is not under test here
            f.write("engine:\n  calibrate: false\n  kv_cache_gib: 0.125\n")
        for i in range(2):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "cli", "worker", "--model", str(model_dir)]
            cmd += ["--port", str(port), "--served-model-name", "small", "--config", config]
            log = open(os.path.join(tmp, f"worker-{i}.log"), "wb")  # noqa: SIM115 (kept open)
            self.procs[url] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        for url, proc in self.procs.items():
            wait_ready(url, 120, proc)

    def serving(self, gw) -> str:
        """The replica the gateway's one request in flight is on now."""
        (flight,) = list(gw.flights)
        worker = flight.attempts[-1].lease.worker
        assert worker is not None
        return worker.url

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def stack(real_model_dir):
    # The default model in fp32 (the parity reference) decodes slowly enough on a CPU that
    # a worker stopped after a few tokens is stopped mid-answer.
    tmp = tempfile.mkdtemp(prefix="sy-resume-")
    workers = Workers(real_model_dir, tmp)
    try:
        with start_redis() as redis_url:
            redis.Redis.from_url(redis_url).flushdb()
            cfg = GatewayConfig(
                pools={"small": list(workers.procs)},
                tokenizers={"small": str(real_model_dir)},
                data_dir=tmp,
                admin_key=ADMIN,
                default_pool="small",
                load_poll_interval_s=0.05,
                stream_idle_timeout_s=1.0,  # a stopped worker is given up on after 1 s
                door=False,
            )
            gw = build_gateway(cfg, redis_url)
            with serving(create_gateway_app(gw)) as url:
                assert eventually(lambda: httpx.get(f"{url}/ready").status_code == 200)
                yield url, workers, redis_url, gw
    finally:
        workers.stop()


def _key(url: str, tenant: str) -> str:
    admin = {"authorization": f"Bearer {ADMIN}"}
    assert httpx.post(f"{url}/admin/tenants", json={"tenant_id": tenant}, headers=admin).is_success
    return httpx.post(
        f"{url}/admin/tenants/{tenant}/keys", json={"name": "k"}, headers=admin
    ).json()["key"]


def _stream(url: str, key: str, body: dict, on_token=None) -> tuple[str, list[dict]]:
    """The stream's text and chunks; `on_token(n)` after each output chunk read."""
    chunks, text, n = [], "", 0
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            for choice in chunk.get("choices") or []:
                text += choice["delta"].get("content") or ""
                n += 1
                if on_token is not None:
                    on_token(n)
    return text, chunks


def _body(**extra) -> dict:
    return {
        "model": "small",
        "messages": [{"role": "user", "content": "Tell me a long story about the sea"}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


@pytest.mark.parametrize(
    ("sampling", "how"),
    [({"temperature": 1.0, "seed": 11}, signal.SIGSTOP), ({"temperature": 0}, signal.SIGKILL)],
    ids=["seeded-sigstop", "greedy-sigkill"],
)
def test_a_stream_whose_worker_dies_goes_on_on_the_other_replica_identically(
    stack, caplog, sampling, how
):
    url, workers, redis_url, gw = stack
    tenant = f"resume-{how.name.lower()}"
    key = _key(url, tenant)
    whole, whole_chunks = _stream(url, key, _body(**sampling))
    told_whole = whole_chunks[-1]["usage"]["total_tokens"]
    assert eventually(lambda: tokens_charged(redis_url, tenant) == told_whole)
    assert len(whole_chunks) > 4 * CUT_AFTER  # long enough to be cut mid-way

    victim: list[str] = []

    def stop_its_worker(n: int) -> None:
        if n == CUT_AFTER:
            victim.append(workers.serving(gw))
            os.kill(workers.procs[victim[0]].pid, how)

    caplog.set_level(logging.INFO, logger="gateway.access")
    text, chunks = _stream(url, key, _body(**sampling), on_token=stop_its_worker)
    assert victim
    if how is signal.SIGSTOP:  # woken, it sends nothing more here and rejoins the pool
        os.kill(workers.procs[victim[0]].pid, signal.SIGCONT)
        assert eventually(lambda: gw.pools["small"].views[victim[0]].state == "ready")
    assert text == whole  # byte for byte: nothing missing, nothing twice
    assert len({c["id"] for c in chunks}) == 1  # one stream, under one id
    assert sum(1 for c in chunks for ch in c["choices"] if "role" in ch["delta"]) == 1
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == whole_chunks[-1]["usage"]["completion_tokens"]
    assert usage["prompt_tokens"] == whole_chunks[-1]["usage"]["prompt_tokens"]
    assert eventually(
        lambda: tokens_charged(redis_url, tenant) == told_whole + usage["total_tokens"]
    )

    def access_line_says_resumed() -> bool:  # written once the request has settled
        lines = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
        return any("resumes=1" in line and "status=200" in line for line in lines)

    assert eventually(access_line_says_resumed)
    reason = "lost" if how is signal.SIGKILL else "idle"
    assert gw.metrics.resumes.labels("small", reason)._value.get() >= 1


def test_a_stream_that_cannot_be_resumed_ends_in_band_as_before(stack):
    """Tools are not resumed (their call parser would go on from the middle): the worker's
    death is an in-band error, and the tenant is charged what was relayed."""
    url, workers, redis_url, gw = stack
    key = _key(url, "noresume")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    victim: list[str] = []

    def kill(n: int) -> None:
        if n == CUT_AFTER:
            victim.append(workers.serving(gw))
            os.kill(workers.procs[victim[0]].pid, signal.SIGKILL)

    _, chunks = _stream(url, key, _body(tools=tools, temperature=0), on_token=kill)
    assert victim
    assert chunks[-1]["error"]["code"] == "upstream_failed"
    relayed = sum(1 for c in chunks for _ in c.get("choices") or [])
    assert eventually(lambda: tokens_charged(redis_url, "noresume") >= relayed)
