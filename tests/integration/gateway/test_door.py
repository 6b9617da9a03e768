"""The door in a real gateway: told that the light tenant always suffers (a negative
tolerance), it holds the tenant over its share to one request in flight, lets the light
tenant past its lane, refuses a request that waited too long with a 429 before any
per-request work (it never reaches a worker), and counts the refusal."""

from concurrent.futures import ThreadPoolExecutor

from tests.integration.gateway.conftest import gateway_stack
from tests.support.waiting import eventually

BODY = {"model": "small", "prompt": [5, 6, 7, 8], "max_tokens": 2}


def test_the_door_holds_the_flood_in_its_lane_and_lets_the_light_tenant_past(redis_url):
    with gateway_stack(
        redis_url,
        replicas={"small": 1},
        door=True,
        door_tolerance_s=-1.0,  # the light tenant's latency always counts as suffering
        door_window_s=600.0,
        door_max_wait_s=1.25,
        door_refusal_delay_s=0.0,
    ) as s:
        gate, backend = s.gateway.gate, s.backends["small0"]
        heavy, light = s.tenant("heavy"), s.tenant("light")
        with s.client(heavy) as h, s.client(light) as lt:
            # A key's first request passes the door unknown (authentication caches it);
            # then heavy is admitted 3 times and light once: heavy is over its share.
            for _ in range(4):
                assert h.post("/v1/completions", json=BODY).status_code == 200
            for _ in range(2):
                assert lt.post("/v1/completions", json=BODY).status_code == 200
            assert eventually(lambda: gate.limit == 1.0)
            backend.token_delay_s = 0.25  # 2 tokens: each request holds its place 0.5 s
            served_before = backend.total

            def heavy_one(i: int):  # noqa: ANN202
                body = {**BODY, "user": f"heavy-{i}"}
                return h.post("/v1/completions", json=body)

            with ThreadPoolExecutor(4) as pool:
                floods = [pool.submit(heavy_one, i) for i in range(4)]
                assert eventually(lambda: gate.waiting == 3)  # one in flight, three in the lane
                r = lt.post("/v1/completions", json={**BODY, "user": "light"})
                assert r.status_code == 200
                answers = [f.result() for f in floods]

        # heavy's requests took their turns 0.5 s apart; the fourth would have waited
        # 1.5 s, past door_max_wait_s, and was refused without reaching the backend.
        statuses = sorted(a.status_code for a in answers)
        assert statuses == [200, 200, 200, 429], [a.text for a in answers]
        refused = next(a for a in answers if a.status_code == 429)
        assert refused.json()["error"]["code"] == "gateway_busy"
        assert int(refused.headers["retry-after"]) >= 1
        assert backend.total - served_before == 4
        users = [b.get("user") for b in list(backend.bodies)[-4:]]
        assert users.index("light") == 1  # past the lane: right after heavy's first
        with s.admin() as a:
            metrics = a.get("/metrics").text
    assert 'switchyard_gateway_door_refusals_total{tenant="heavy"} 1.0' in metrics
    assert "switchyard_gateway_door_limit 1.0" in metrics


def test_an_unknown_key_passes_the_door_to_be_refused_by_authentication(redis_url):
    with gateway_stack(redis_url, replicas={"small": 1}, door=True, door_tolerance_s=-1.0) as s:
        key = s.tenant("acme")
        with s.client(key) as c:
            assert c.post("/v1/completions", json=BODY).status_code == 200
        with s.client("sy-unknown-key") as c:
            r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_usage_requests_pass_the_door_and_wait_in_their_tenants_lane(redis_url):
    """/v1/usage costs the gateway Redis round trips: a tenant calling it is counted at the
    door, and over its share it waits in its lane like its completions do."""
    with gateway_stack(
        redis_url,
        replicas={"small": 1},
        door=True,
        door_tolerance_s=-1.0,  # the light tenant's latency always counts as suffering
        door_window_s=600.0,
        door_max_wait_s=20.0,
        door_refusal_delay_s=0.0,
    ) as s:
        gate, backend = s.gateway.gate, s.backends["small0"]
        heavy, light = s.tenant("heavy"), s.tenant("light")
        with s.client(heavy) as h, s.client(light) as lt:
            for _ in range(4):  # the first passes the door unknown; then heavy is counted
                assert h.get("/v1/usage").status_code == 200
            assert lt.post("/v1/completions", json=BODY).status_code == 200
            assert lt.post("/v1/completions", json=BODY).status_code == 200
            assert gate.shares.over_share("heavy") and not gate.shares.over_share("light")
            assert eventually(lambda: gate.limit == 1.0)
            backend.token_delay_s = 2.0  # 2 tokens: heavy's completion holds its place 4 s
            with ThreadPoolExecutor(2) as pool:
                held = pool.submit(h.post, "/v1/completions", json=BODY)
                assert eventually(lambda: gate.in_flight.get("heavy") == 1)
                usage = pool.submit(h.get, "/v1/usage")
                assert eventually(lambda: gate.waiting == 1)  # behind heavy's completion
                assert lt.get("/v1/usage").status_code == 200  # light is under its share
                assert gate.waiting == 1 and not usage.done()
                assert held.result().status_code == 200
                assert usage.result().status_code == 200
