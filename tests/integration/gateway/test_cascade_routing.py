"""`model: auto` through the gateway with real Redis: routing by score, runtime thresholds
shared by gateway processes, overflow, escalation, and classifier failure."""

import threading
import time

import httpx

from tests.integration.gateway.conftest import ADMIN, Stack, gateway_stack
from tests.support.servers import gateway_process
from tests.support.waiting import eventually
from tests.support.worker import free_port

CASCADE = {"cascade_small_pool": "small", "cascade_large_pool": "large"}
EASY = "hi"
HARD = (
    "Let f(x) = x^3 - 6x^2 + 11x - 6. Find all real roots, prove there are no others, "
    "and compute the integral of f from 0 to 3. Show every step.\n```python\nprint(1)\n```"
)


def auto(prompt: str, **kw) -> dict:
    return {"model": "auto", "prompt": prompt, "max_tokens": 4, **kw}


def put_routing(s: Stack, **settings) -> httpx.Response:
    with s.admin() as a:
        return a.put("/admin/routing", json=settings)


def test_auto_routes_by_score_against_the_threshold(redis_url):
    with gateway_stack(redis_url, **CASCADE) as s:
        key = s.tenant("auto")
        with s.client(key) as c:
            easy = c.post("/v1/completions", json=auto(EASY))
            hard = c.post("/v1/completions", json=auto(HARD))
        scores = {
            p: float(r.headers["x-switchyard-score"]) for p, r in ((EASY, easy), (HARD, hard))
        }
        assert scores[HARD] > scores[EASY]
        middle = (scores[EASY] + scores[HARD]) / 2
        assert put_routing(s, default_threshold=middle).status_code == 200
        with s.client(key) as c:
            easy = c.post("/v1/completions", json=auto(EASY))
            hard = c.post("/v1/completions", json=auto(HARD))
        assert easy.headers["x-switchyard-model"] == "small"
        assert hard.headers["x-switchyard-model"] == "large"
        assert {easy.headers["x-switchyard-route"], hard.headers["x-switchyard-route"]} == {
            "classifier"
        }
        assert float(hard.headers["x-switchyard-threshold"]) == round(middle, 4)


def test_invalid_routing_changes_nothing(redis_url):
    with gateway_stack(redis_url, **CASCADE) as s:
        s.tenant("known")
        before = s.admin().get("/admin/routing").json()
        r = put_routing(s, default_threshold=1.5)
        assert r.status_code == 400 and r.json()["error"]["param"]
        r = put_routing(s, tenant_thresholds={"ghost": 0.3})
        assert r.status_code == 400
        assert s.admin().get("/admin/routing").json() == before
        ok = put_routing(s, tenant_thresholds={"known": 0.3})
        assert ok.status_code == 200 and ok.json()["version"] == before["version"] + 1
        audit = s.admin().get("/admin/routing/audit").json()["data"]
        assert audit[0]["new"]["tenant_thresholds"] == {"known": 0.3} and audit[0]["who"]


def test_a_threshold_change_reaches_another_gateway_process_within_a_second(redis_url, tmp_path):
    with gateway_stack(redis_url, **CASCADE) as s:
        key = s.tenant("shared")
        port = free_port()
        cfg = {
            "gateway": {
                "pools": {"small": [s.backend_urls["small0"]], "large": [s.backend_urls["large0"]]},
                "redis_url": redis_url,
                "admin_key": ADMIN,
                "routing_poll_s": 0.5,
                **CASCADE,
            }
        }
        with gateway_process(cfg["gateway"], tmp_path, port) as other:
            headers = {"authorization": f"Bearer {key}"}
            assert put_routing(s, default_threshold=0.0).status_code == 200
            assert _eventually(
                lambda: (
                    httpx.post(f"{other}/v1/completions", json=auto(EASY), headers=headers).headers[
                        "x-switchyard-model"
                    ]
                    == "large"
                )
            )
            changed_at = time.monotonic()
            assert put_routing(s, default_threshold=1.0).status_code == 200
            while True:
                r = httpx.post(f"{other}/v1/completions", json=auto(EASY), headers=headers)
                if r.headers["x-switchyard-model"] == "small":
                    break
                assert time.monotonic() - changed_at < 1.0, "not applied within a second"
                time.sleep(0.05)


def test_overflow_to_small_when_the_large_pool_is_saturated(redis_url):
    with gateway_stack(redis_url, max_inflight_per_worker=1, **CASCADE) as s:
        s.backends["large0"].token_delay_s = 0.1
        key = s.tenant("ovf")
        strict = s.tenant("strict")
        with s.admin() as a:
            a.patch("/admin/tenants/strict", json={"allow_overflow": False})
        assert put_routing(s, default_threshold=0.0, overflow_max_wait_s=0.5).status_code == 200
        # Fill the large pool: one in flight, one waiting.
        fillers = [
            threading.Thread(
                target=httpx.post,
                args=(f"{s.url}/v1/completions",),
                kwargs={
                    "json": auto(HARD, max_tokens=10),
                    "timeout": 30,
                    "headers": {"authorization": f"Bearer {key}"},
                },
            )
            for _ in range(2)
        ]
        pool = s.gateway.pools["large"]
        fillers[0].start()
        assert _eventually(lambda: s.backends["large0"].active == 1)
        fillers[1].start()
        assert _eventually(lambda: len(pool.queue) == 1)
        with s.client(key) as c:
            r = c.post("/v1/completions", json=auto(HARD))
        assert r.status_code == 200
        assert (r.headers["x-switchyard-model"], r.headers["x-switchyard-route"]) == (
            "small",
            "overflow",
        )
        with s.client(strict) as c:
            r = c.post("/v1/completions", json=auto(HARD))
        assert r.headers["x-switchyard-model"] == "large"  # waited its turn instead
        for t in fillers:
            t.join()


def test_overflow_to_small_when_the_large_pool_would_miss_its_ttft_target(redis_url):
    """No queue at all, but the large pool's capacity model predicts this prompt's prefill
    alone takes past its TTFT target: the cascade sends it to the small pool, and a tenant
    that may not overflow is refused before any token, with Retry-After."""
    with gateway_stack(redis_url, ttft_target_s={"large": 0.5}, **CASCADE) as s:
        large = s.backends["large0"]
        large.seats, large.decode_step_s, large.prefill_tokens_per_s = 4, 0.01, 20.0
        key, strict = s.tenant("ovf"), s.tenant("strict")
        with s.admin() as a:
            a.patch("/admin/tenants/strict", json={"allow_overflow": False})
        assert put_routing(s, default_threshold=0.0, overflow_max_wait_s=30).status_code == 200
        view = s.gateway.pools["large"].views[s.backend_urls["large0"]]
        assert eventually(lambda: view.seats == 4 and view.prefill_tokens_per_s == 20.0)
        with s.client(key) as c:
            short = c.post("/v1/completions", json=auto("a b"))  # 1 token of prefill: in time
            long = c.post("/v1/completions", json=auto(HARD))  # ~60 tokens: 3 s of prefill
        assert (short.headers["x-switchyard-model"], long.headers["x-switchyard-model"]) == (
            "large",
            "small",
        )
        assert long.headers["x-switchyard-route"] == "overflow"
        with s.client(strict) as c:
            r = c.post("/v1/completions", json=auto(HARD))
        assert r.status_code == 503 and "retry-after" in r.headers, r.text
        assert r.json()["error"]["code"] == "over_capacity"
        assert s.backends["large0"].total == 1 and s.backends["small0"].total == 1


def test_unsure_small_answer_escalates_and_both_attempts_are_charged(redis_url):
    with gateway_stack(redis_url, **CASCADE) as s:
        key = s.tenant("esc")
        settings = {
            "default_threshold": 1.0,
            "escalation": {
                "esc": {"enabled": True, "min_mean_logprob": -1.0, "min_token_logprob": -4.0}
            },
        }
        assert put_routing(s, **settings).status_code == 200
        with s.client(key) as c:
            sure = c.post("/v1/completions", json=auto(EASY))
            assert sure.headers["x-switchyard-route"] == "classifier"
            assert sure.json()["choices"][0]["logprobs"] is None  # not asked for
            s.backends["small0"].logprob = -5.0
            unsure = c.post("/v1/completions", json=auto(EASY))
        assert unsure.status_code == 200
        assert (unsure.headers["x-switchyard-model"], unsure.headers["x-switchyard-route"]) == (
            "large",
            "escalated",
        )
        assert unsure.json()["choices"][0]["text"] == "llll"  # the large pool's answer
        assert s.backends["large0"].total == 1
        # The fake reports 1 prompt token + 4 completion tokens per attempt: the sure request
        # made one attempt, the unsure one two (small, then large).
        assert _eventually(lambda: s.charged("esc") == 3 * 5)
        metrics = httpx.get(f"{s.url}/metrics").text
        assert 'switchyard_cascade_escalations_total{changed="true"} 1.0' in metrics


def _eventually(predicate, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_classifier_failure_routes_to_the_small_pool_and_is_counted(redis_url):
    with gateway_stack(redis_url, **CASCADE) as s:
        key = s.tenant("broken")
        gw_router = _router_of(s)

        class Broken:
            name = "broken"

            def score(self, *a, **k):
                raise RuntimeError("model file corrupt")

        gw_router.scorer = Broken()
        with s.client(key) as c:
            r = c.post("/v1/completions", json=auto(HARD))
        assert (r.headers["x-switchyard-model"], r.headers["x-switchyard-route"]) == (
            "small",
            "fallback",
        )
        assert (
            "switchyard_cascade_classifier_failures_total 1.0" in httpx.get(f"{s.url}/metrics").text
        )


def _router_of(s: Stack):
    return s.gateway.router


def test_threshold_precedence_request_then_key_then_tenant_then_default(redis_url):
    with gateway_stack(redis_url, **CASCADE) as s:
        key = s.tenant("prec")
        with s.admin() as a:
            key_id = a.get("/admin/tenants/prec/keys").json()["data"][0]["key_id"]
        settings = {"default_threshold": 0.0, "tenant_thresholds": {"prec": 1.0}}
        assert put_routing(s, **settings).status_code == 200
        with s.client(key) as c:
            assert (
                c.post("/v1/completions", json=auto(HARD)).headers["x-switchyard-model"] == "small"
            )
            assert put_routing(s, **settings, key_thresholds={key_id: 0.0}).status_code == 200
            r = c.post("/v1/completions", json=auto(HARD))
            assert (r.headers["x-switchyard-model"], r.headers["x-switchyard-threshold"]) == (
                "large",
                "0.0000",
            )
            r = c.post("/v1/completions", json=auto(HARD, switchyard_threshold=1.0))
            assert r.headers["x-switchyard-model"] == "small"
