"""The capacity model and its decisions, shown: a request refused for its TTFT target is
counted under its reason in /metrics and GET /admin/fleet, requests served in time count
in goodput, and the workers' model (seats, step, prefill rate, ITL target) is in the fleet."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.gateway.conftest import gateway_stack
from tests.support.waiting import eventually


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_refusals_goodput_and_the_model_show_in_metrics_and_the_fleet(redis_url):
    with gateway_stack(redis_url, replicas={"small": 1}, ttft_target_s={"small": 2.0}) as s:
        backend = s.backends["small0"]
        # 20 prompt tokens a second: a 100-token prompt alone takes 5 s, past the 2 s target.
        backend.seats, backend.decode_step_s, backend.prefill_tokens_per_s = 4, 0.01, 20.0
        backend.itl_target_s, backend.step_s = 1.0, 0.009
        view = s.gateway.pools["small"].views[s.backend_urls["small0"]]
        assert eventually(lambda: view.seats == 4 and view.itl_target_s == 1.0)
        key = s.tenant("acme")
        small = {"model": "small", "max_tokens": 4}
        with s.client(key) as c:
            refused = c.post("/v1/completions", json={**small, "prompt": [5] * 100})
            streamed = c.post("/v1/completions", json={**small, "prompt": [5, 6], "stream": True})
            whole = c.post("/v1/completions", json={**small, "prompt": [5, 6]})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "over_capacity"
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        assert whole.status_code == 200
        assert backend.total == 2  # the refused one never reached the worker

        def capacity() -> dict:
            with s.admin() as a:
                return a.get("/admin/fleet").json()["small"]["capacity"]

        # Both settle after their answers were sent: wait for the count, not the clock.
        assert eventually(lambda: capacity()["served"] == 2)
        cap = capacity()
        assert cap["refusals"] == {"predicted": 1}
        assert cap["goodput"] == 2  # both well within 2 s, token gaps within 1 s
        assert (cap["ttft_target_s"], cap["itl_target_s"]) == (2.0, 1.0)
        # A typical request (2 prompt tokens) now: a seat is free, 0.1 s of prefill, a step.
        assert cap["predicted_ttft_s"] == pytest.approx(2 / 20 + 0.01, abs=1e-3)
        assert cap["workers"] == [
            {
                "url": s.backend_urls["small0"],
                "seats": 4,
                "decode_step_s": 0.01,
                "prefill_tokens_per_s": 20.0,
                "step_s": 0.009,
                "itl_target_s": 1.0,
            }
        ]

        m = samples(s.url)
        p = "switchyard_gateway_"
        assert m[(p + "refusals_total", (("pool", "small"), ("reason", "predicted")))] == 1
        assert m[(p + "refusals_total", (("pool", "small"), ("reason", "queue_full")))] == 0
        assert m[(p + "served_requests_total", (("pool", "small"),))] == 2
        assert m[(p + "goodput_requests_total", (("pool", "small"),))] == 2
        assert m[(p + "ttft_target_seconds", (("pool", "small"),))] == 2.0
        assert m[(p + "itl_target_seconds", (("pool", "small"),))] == 1.0
        predicted = m[(p + "predicted_ttft_seconds", (("pool", "small"),))]
        assert predicted == pytest.approx(2 / 20 + 0.01, abs=1e-3)


def test_a_stream_whose_first_token_comes_past_its_target_is_served_but_not_goodput(redis_url):
    with gateway_stack(redis_url, replicas={"small": 1}, ttft_target_s={"small": 0.2}) as s:
        backend = s.backends["small0"]
        backend.mode = "slow_first"  # the first token after 0.5 s, past the 0.2 s target
        key = s.tenant("acme")
        with s.client(key) as c:
            r = c.post("/v1/completions", json={"model": "small", "prompt": [5, 6],
                                                "max_tokens": 3, "stream": True})  # fmt: skip
        assert r.status_code == 200 and "[DONE]" in r.text
        pool = s.gateway.pools["small"]
        assert eventually(lambda: pool.goodput.served == 1)
        assert pool.goodput.met == 0
        m = samples(s.url)
        assert m[("switchyard_gateway_goodput_requests_total", (("pool", "small"),))] == 0
        # No capacity model reported: admission predicted nothing, and shows nothing.
        assert ("switchyard_gateway_predicted_ttft_seconds", (("pool", "small"),)) not in m
