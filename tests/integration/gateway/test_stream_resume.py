"""Streams that outlive their replica, with real worker processes behind a real gateway:
a worker SIGKILLed (or SIGSTOPped, or drained past its grace) mid-stream hands the stream
to another replica, and the client's text equals the uninterrupted answer's, byte for
byte, greedy and seeded, structured output and a tool call cut in its arguments too, with
one usage and one charge; the access line and /metrics say it resumed."""

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
    """Three `switchyard worker` processes of the model, one pool's replicas. The SIGSTOP
    tests run first and wake their worker after; the drain test leaves two, the SIGKILL
    test one, and the last test kills that."""

    def __init__(self, model_dir, tmp) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        config = os.path.join(tmp, "worker.yaml")
        # No start-up calibration (it is not under test here), and one thread each: three
        # workers share the machine's cores with the gateway and the test.
        with open(config, "w") as f:
            f.write("engine:\n  calibrate: false\n  kv_cache_gib: 0.125\n  threads: 1\n")
        for i in range(3):
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
                # A stopped worker is given up on after this long without a byte. At 1 s a
                # worker merely slowed by a busy machine (other tests, a build) was given up
                # on before its first token, and every attempt of a stream with it.
                stream_idle_timeout_s=4.0,
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


def _calls(chunks: list[dict]) -> list[tuple[int, dict]]:
    """The tool calls a stream sent: (index, function) of each `tool_calls` delta."""
    return [
        (call["index"], call["function"])
        for c in chunks
        for choice in c.get("choices") or []
        for call in choice["delta"].get("tool_calls") or []
    ]


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


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
GUIDED = {
    "structured": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": WEATHER["function"]["parameters"]},
        }
    },
    "tool-call": {
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
}


@pytest.mark.parametrize("guided", list(GUIDED))
def test_a_guided_stream_cut_mid_document_goes_on_in_its_grammar(stack, guided):
    """Structured output and a forced tool call, cut after a few tokens (inside the JSON,
    inside the call's arguments): the continuation's grammar and tool-call reader go on
    from there; the document is the uninterrupted one, the call is sent once, whole."""
    url, workers, _, gw = stack
    key = _key(url, f"resume-{guided}")
    body = _body(temperature=0, **GUIDED[guided])
    whole, whole_chunks = _stream(url, key, body)
    victim: list[str] = []

    def stop_its_worker(n: int) -> None:
        if n == CUT_AFTER:
            victim.append(workers.serving(gw))
            os.kill(workers.procs[victim[0]].pid, signal.SIGSTOP)

    try:
        text, chunks = _stream(url, key, body, on_token=stop_its_worker)
    finally:
        for v in victim:
            os.kill(workers.procs[v].pid, signal.SIGCONT)
    assert victim
    assert eventually(lambda: gw.pools["small"].views[victim[0]].state == "ready")
    assert len({c["id"] for c in chunks}) == 1
    if guided == "structured":
        assert text == whole and set(json.loads(text)) == {"city", "unit"}
    else:
        (call,) = _calls(whole_chunks)
        assert json.loads(call[1]["arguments"])["city"] in ("Paris", "Rome")
        assert _calls(chunks) == [call] and text == whole == ""
        assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == whole_chunks[-1]["usage"]["completion_tokens"]


def test_a_drained_replica_hands_its_stream_over_and_exits_once_empty(stack, caplog):
    """`POST /drain` with a grace: past it, the worker ends its resumable stream with a
    `handed_over` event, which the gateway never relays: it goes on on another replica,
    identically, and the drained worker exits 0 (nothing left to wait for). How soon:
    `switchyard bench resume --drain-tokens 2000`."""
    url, workers, redis_url, gw = stack
    key = _key(url, "resume-drain")
    body = _body(temperature=0)
    whole, whole_chunks = _stream(url, key, body)
    victim: list[str] = []

    def drain_its_worker(n: int) -> None:
        if n == CUT_AFTER:
            victim.append(workers.serving(gw))
            r = httpx.post(f"{victim[0]}/drain", json={"exit_when_empty": True, "grace_s": 0})
            assert r.status_code == 200 and r.json()["state"] == "draining"

    caplog.set_level(logging.INFO, logger="gateway.access")
    text, chunks = _stream(url, key, body, on_token=drain_its_worker)
    assert victim
    assert workers.procs[victim[0]].wait(30) == 0
    assert text == whole and len({c["id"] for c in chunks}) == 1
    assert not any("error" in c for c in chunks)
    for count in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert chunks[-1]["usage"][count] == whole_chunks[-1]["usage"][count]
    assert gw.metrics.resumes.labels("small", "drain")._value.get() == 1
    assert eventually(
        lambda: any(
            "resumes=1" in r.getMessage() and "status=200" in r.getMessage()
            for r in caplog.records
            if r.name == "gateway.access"
        )
    )


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
    """Two samples in one stream (n = 2) are not resumed: the worker's death is an in-band
    error, and the tenant is charged what was relayed."""
    url, workers, redis_url, gw = stack
    key = _key(url, "noresume")
    victim: list[str] = []

    def kill(n: int) -> None:
        if n == CUT_AFTER:
            victim.append(workers.serving(gw))
            os.kill(workers.procs[victim[0]].pid, signal.SIGKILL)

    _, chunks = _stream(url, key, _body(n=2, temperature=1.0, seed=3), on_token=kill)
    assert victim
    assert chunks[-1]["error"]["code"] == "upstream_failed"
    relayed = sum(1 for c in chunks for _ in c.get("choices") or [])
    assert eventually(lambda: tokens_charged(redis_url, "noresume") >= relayed)
