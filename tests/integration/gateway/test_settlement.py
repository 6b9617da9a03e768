"""A request settles when its serving ends, not when an object is collected: with the cycle
collector off, a stream whose answer could not begin (its client gone) and a stream whose
client leaves mid-answer both give back their slot and are charged what they used."""

import gc
import tempfile
from contextlib import ExitStack, contextmanager

import httpx
import pytest
import redis

from benchmarks.fake_backend import FakeBackend
from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.runtime.main import build_gateway
from tests.integration.gateway.conftest import ADMIN, Stack
from tests.integration.gateway.faults_support import (
    BODY,
    PROMPT,
    gateway_over,
    stream_body,
    usage,
)
from tests.support.servers import serving, wait_ready
from tests.support.waiting import eventually


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class LosesStreams:
    """The gateway's app, behind a transport that fails to start any stream's answer: as a
    client that left just before the response began."""

    def __init__(self, app) -> None:  # noqa: ANN001
        self.app = app

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def failing(message: dict) -> None:
            if message["type"] == "http.response.start" and (
                b"content-type",
                b"text/event-stream",
            ) in [(k, v.split(b";")[0]) for k, v in message["headers"]]:
                raise OSError("the client is gone")
            await send(message)

        await self.app(scope, receive, failing)


@contextmanager
def stack_losing_streams(redis_url: str):
    """A gateway over one fake backend (fresh Redis db), served behind `LosesStreams`."""
    redis.Redis.from_url(redis_url).flushdb()
    backend = FakeBackend(name="small0")
    with ExitStack() as stack:
        cfg = GatewayConfig(
            pools={"small": [stack.enter_context(serving(backend))]},
            data_dir=stack.enter_context(tempfile.TemporaryDirectory(prefix="sy-gw-")),
            admin_key=ADMIN,
            load_poll_interval_s=0.05,
        )
        gw = build_gateway(cfg, redis_url)
        url = stack.enter_context(serving(LosesStreams(create_gateway_app(gw))))
        wait_ready(url, 10)
        yield Stack(url, {"small0": backend}, {}, redis_url, gw)


def test_a_stream_whose_answer_cannot_begin_settles_without_the_collector(redis_url, no_gc):
    with stack_losing_streams(redis_url) as s:
        key = s.tenant("gone", tokens_per_minute=10_000)
        with s.client(key) as c:
            try:
                assert c.post("/v1/completions", json=stream_body()).status_code >= 500
            except httpx.TransportError:
                pass  # the server closed the connection instead: as good
        gw, backend = s.gateway, s.backends["small0"]
        assert eventually(lambda: not gw.flights, 5), gw.flights
        assert eventually(lambda: usage(s.url, key)["concurrent_requests"] == 0, 5)
        assert all(v.inflight == 0 for v in gw.pools["small"].views.values())
        # The worker accepted the stream: it pays the prompt, and the worker saw it abandoned.
        assert eventually(lambda: s.charged("gone") == len(PROMPT), 5)
        assert eventually(lambda: backend.active == 0, 5)
        with s.client(key) as c:  # and the gateway serves on
            assert c.post("/v1/completions", json=BODY).status_code == 200


def test_a_client_leaving_mid_stream_settles_without_the_collector(redis_url, no_gc):
    backend = FakeBackend(name="small0", token_delay_s=0.02)
    with serving(backend) as url, gateway_over(redis_url, {"small": [url]}) as s:
        key = s.tenant("leaves", tokens_per_minute=10_000)
        with s.client(key) as c:
            body = {**BODY, "max_tokens": 200, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                for _ in range(3):
                    next(line for line in lines if line.startswith("data: "))
        assert eventually(lambda: not s.gateway.flights, 5)
        assert eventually(lambda: usage(s.url, key)["concurrent_requests"] == 0, 5)
        assert eventually(lambda: backend.active == 0, 5) and backend.aborted == 1
        used = s.charged("leaves")
        assert len(PROMPT) + 3 <= used <= len(PROMPT) + 20, used
