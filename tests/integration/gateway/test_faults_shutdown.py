"""A gateway process given SIGTERM while requests hang on a worker: it exits within its
grace, answers what it cut in the OpenAI shape, and settles its own books."""

import signal
import time
from dataclasses import dataclass

import pytest

from tests.integration.gateway.conftest import gateway_stack
from tests.integration.gateway.faults_support import (
    BIG,
    BODY,
    PROMPT,
    Background,
    Result,
    metric,
    stream_body,
    subprocess_config,
    usage,
    wait_until,
)
from tests.support.servers import gateway_proc

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
