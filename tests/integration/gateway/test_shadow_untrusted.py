"""A shadow run's answer is as untrusted as a routed one: a real gateway whose large pool is
a worker misbehaving on the wire (`rogue_worker.RogueWorker`), every `auto` request routed
small and shadowed large. The gateway reads the shadow answer within the request's answer
bound and within SHADOW_TIMEOUT_S, then hangs up and counts the run failed."""

import time
from contextlib import contextmanager

import httpx
import pytest

from benchmarks.fake_backend import FakeBackend
from gateway.learning import learner
from tests.integration.gateway.faults_support import BIG, gateway_over, wait_until
from tests.integration.gateway.rogue_worker import RogueWorker
from tests.support.servers import serving

BODY = {"model": "auto", "prompt": [5, 6, 7, 8], "max_tokens": 6}
ROUTING = {
    "default_threshold": 1.0,  # everything small, shadowed on the large (rogue) pool
    "default_target_fraction": None,
    "learning": {"acme": {"shadow_fraction": 1.0, "judge": "exact"}},
    "shadow_tokens_per_minute": 10**6,
}


def _failed(s) -> float:  # noqa: ANN001
    registry = s.gateway.registry
    return registry.get_sample_value("switchyard_cascade_shadow_runs_total", {"outcome": "failed"})


@contextmanager
def _shadowed_on_the_rogue(redis_url: str, rogue: RogueWorker, mode: str):  # noqa: ANN202
    small = FakeBackend(name="small0")
    with serving(small) as small_url:
        pools = {"small": [small_url], "large": [rogue.url]}
        with gateway_over(
            redis_url,
            pools,
            door=False,
            default_pool="small",
            routing_poll_s=0.1,
            cascade_small_pool="small",
            cascade_large_pool="large",
        ) as s:
            key = s.tenant("acme", tokens_per_day=BIG)
            with s.admin() as a:
                assert a.put("/admin/routing", json=ROUTING).status_code == 200
            wait_until(lambda: s.gateway.router.settings.learning, 10, "the routing settings")
            rogue.mode = mode
            auth = {"authorization": f"Bearer {key}"}
            r = httpx.post(f"{s.url}/v1/completions", json=BODY, headers=auth, timeout=30)
            assert r.status_code == 200 and r.headers["x-switchyard-model"] == "small", r.text
            t0 = time.monotonic()
            wait_until(lambda: _failed(s), 20, "the shadow run counted failed")
            yield s, time.monotonic() - t0


@pytest.mark.timeout(90)
def test_an_endless_shadow_answer_is_cut_at_the_answer_bound(redis_url):
    """Before, the learner read up to the client's 64 MiB default."""
    with RogueWorker() as rogue:
        with _shadowed_on_the_rogue(redis_url, rogue, "endless") as (s, _):
            wait_until(lambda: rogue.dropped == 1, 10, "the gateway hung up on the worker")
            bound = s.gateway.config.upstream_min_answer_bytes + 4096 * BODY["max_tokens"]
            # what the sockets' buffers hold on top of what the gateway read (a few MiB)
            assert rogue.sent_bytes < bound + (16 << 20), rogue.sent_bytes
            assert [p.get("priority") for p in rogue.posts] == [learner.SHADOW_PRIORITY]


@pytest.mark.timeout(90)
def test_a_shadow_answer_that_stops_coming_is_given_up_at_the_shadow_timeout(
    redis_url, monkeypatch
):
    """Before, the learner waited for the rest of the body without end."""
    monkeypatch.setattr(learner, "SHADOW_TIMEOUT_S", 1.0)
    with RogueWorker() as rogue:
        with _shadowed_on_the_rogue(redis_url, rogue, "stall_body") as (s, waited_s):
            assert waited_s < 5.0, waited_s
            assert s.gateway.pools["large"].has_room()  # the run's slot is given back
