"""The door in a real gateway: told it is saturated (a lag threshold below zero), it refuses
the tenant over its share with a 429 before any per-request work (nothing reserved, nothing
charged), lets the light tenant through, and counts the refusal."""

import time

from tests.integration.gateway.conftest import gateway_stack

BODY = {"model": "small", "prompt": [5, 6, 7, 8], "max_tokens": 2}


def test_a_saturated_gateway_refuses_the_tenant_over_its_share_and_serves_the_other(redis_url):
    with gateway_stack(
        redis_url,
        replicas={"small": 1},
        door_lag_threshold_s=-1.0,  # always saturated
        door_min_rate_per_s=0.0,
        door_window_s=600.0,
        door_refusal_delay_s=0.3,
    ) as s:
        heavy, light = s.tenant("heavy"), s.tenant("light")
        with s.client(heavy) as h, s.client(light) as lt:
            # A key's first request passes the door unknown (authentication then caches it).
            for _ in range(6):  # alone: never refused; 5 counted
                assert h.post("/v1/completions", json=BODY).status_code == 200
            for _ in range(2):  # 1 counted: two tenants are active
                assert lt.post("/v1/completions", json=BODY).status_code == 200
            charged = s.usage(heavy)["tokens_today"]
            t0 = time.monotonic()
            r = h.post("/v1/completions", json=BODY)  # 5 of 6 admitted: over a share of 3
            assert r.status_code == 429, r.text
            assert time.monotonic() - t0 >= 0.3  # held: a client retrying at once is slowed
            assert r.json()["error"]["code"] == "gateway_busy"
            assert int(r.headers["retry-after"]) >= 1
            assert s.usage(heavy)["tokens_today"] == charged  # refused before the quota
            for _ in range(4):  # the light tenant is under its share: served
                assert lt.post("/v1/completions", json=BODY).status_code == 200
            assert h.post("/v1/completions", json=BODY).status_code == 200  # 5 of 10: a share
        with s.admin() as a:
            metrics = a.get("/metrics").text
    assert 'switchyard_gateway_door_refusals_total{tenant="heavy"} 1.0' in metrics


def test_an_unknown_key_passes_the_door_to_be_refused_by_authentication(redis_url):
    with gateway_stack(
        redis_url, replicas={"small": 1}, door_lag_threshold_s=-1.0, door_min_rate_per_s=0.0
    ) as s:
        key = s.tenant("acme")
        with s.client(key) as c:
            assert c.post("/v1/completions", json=BODY).status_code == 200
        with s.client("sy-unknown-key") as c:
            r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
