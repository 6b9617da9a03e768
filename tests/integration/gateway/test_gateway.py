"""The gateway over real HTTP with real Redis: auth, forwarding, quotas, queueing, retries,
relay, cancellation, and bad input that never touches a quota."""

import json
import threading
import time

import httpx
import pytest

from tests.integration.gateway.conftest import gateway_stack
from tests.support.waiting import eventually

BODY = {"model": "small", "prompt": [5, 6, 7, 8], "max_tokens": 6}


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_requests_without_a_valid_key_get_401(stack):
    assert (
        error_of(httpx.post(f"{stack.url}/v1/completions", json=BODY))["code"] == "invalid_api_key"
    )
    r = httpx.post(
        f"{stack.url}/v1/completions", json=BODY, headers={"authorization": "Bearer sy-nope"}
    )
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"


def test_revoked_key_stops_working_on_the_next_request(stack):
    key = stack.tenant("acme")
    with stack.client(key) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200
        with stack.admin() as a:
            key_id = a.get("/admin/tenants/acme/keys").json()["data"][0]["key_id"]
            assert a.delete(f"/admin/keys/{key_id}").status_code == 200
        assert c.post("/v1/completions", json=BODY).status_code == 401


def test_forwarding_sets_headers_cache_salt_and_max_tokens(stack):
    key_a, key_b = stack.tenant("a"), stack.tenant("b")
    with stack.client(key_a) as c:
        r = c.post("/v1/completions", json={"model": "small", "prompt": "hello"})
    assert r.status_code == 200, r.text
    assert r.headers["x-switchyard-model"] == "small"
    assert r.headers["x-switchyard-route"] == "forced"
    assert r.headers["x-request-id"].startswith("gw-")
    with stack.client(key_b) as c:
        c.post("/v1/completions", json={"model": "small", "prompt": "hello"})
    bodies = stack.backends["small0"].bodies
    assert bodies[-2]["max_tokens"] == 256  # the configured cap was injected
    assert bodies[-2]["cache_salt"] != bodies[-1]["cache_salt"]  # per tenant


def test_rate_limit_headers_on_every_response_streams_included(stack):
    key = stack.tenant("t", tokens_per_minute=10_000, requests_per_minute=100)
    with stack.client(key) as c:
        r = c.post("/v1/completions", json=BODY)
        assert r.headers["x-ratelimit-limit-tokens"] == "10000"
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == 10_000 - 10
        assert r.headers["x-ratelimit-limit-requests"] == "100"
        with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as s:
            assert s.headers["x-ratelimit-limit-tokens"] == "10000"
            assert "x-ratelimit-reset-tokens" in s.headers


def test_streaming_relays_every_chunk_and_usage_only_when_asked(stack):
    key = stack.tenant("s")
    with stack.client(key) as c:
        with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) == 6 and all("usage" not in ch for ch in chunks)
        with c.stream(
            "POST",
            "/v1/completions",
            json={**BODY, "stream": True, "stream_options": {"include_usage": True}},
        ) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 6


def test_minute_quota_refuses_with_429_and_jittered_retry_after(stack):
    key = stack.tenant("q", tokens_per_minute=25)
    with stack.client(key) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200  # 4 + 6 = 10
        assert c.post("/v1/completions", json=BODY).status_code == 200  # 20
        refused = [c.post("/v1/completions", json=BODY) for _ in range(4)]
    assert all(r.status_code == 429 for r in refused)
    assert {error_of(r)["code"] for r in refused} == {"rate_limit_exceeded"}
    assert all(1 <= int(r.headers["retry-after"]) <= 62 for r in refused)
    assert len({r.headers["retry-after-ms"] for r in refused}) > 1
    assert stack.charged("q") == 20


def test_day_budget_refuses_with_insufficient_quota(stack):
    key = stack.tenant("d", tokens_per_day=15)
    with stack.client(key) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200
        r = c.post("/v1/completions", json=BODY)
    assert r.status_code == 429 and error_of(r)["code"] == "insufficient_quota"


@pytest.mark.parametrize(
    ("raw", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"prompt": "x"}).encode(), 400, "model"),
        (json.dumps({**BODY, "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({**BODY, "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({**BODY, "stream": "yes"}).encode(), 400, "stream"),
        (json.dumps({**BODY, "model": "nope"}).encode(), 404, "model"),
        (json.dumps({**BODY, "prompt": "x" * 2_000_000}).encode(), 413, None),
    ],
)
def test_bad_input_gets_a_clear_4xx_and_leaves_the_quota_untouched(stack, raw, status, param):
    key = stack.tenant("bad", tokens_per_minute=1000)
    with stack.client(key) as c:
        r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert error_of(r)["param"] == param
    assert stack.charged("bad") == 0
    assert stack.backends["small0"].total == 0


def test_model_not_allowed_is_403_and_context_limit_is_400(stack):
    key = stack.tenant("limited", allowed_models=["small"], max_context=50)
    with stack.client(key) as c:
        r = c.post("/v1/completions", json={**BODY, "model": "large"})
        assert r.status_code == 403 and error_of(r)["code"] == "model_not_allowed"
        r = c.post("/v1/completions", json={**BODY, "max_tokens": 100})
        assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    assert stack.charged("limited") == 0


def test_refusing_replica_is_retried_on_another(redis_url):
    with gateway_stack(redis_url, replicas={"small": 2}) as s:
        s.backends["small0"].mode = "refuse"
        key = s.tenant("r")
        with s.client(key) as c:
            codes = [c.post("/v1/completions", json=BODY).status_code for _ in range(6)]
        assert codes == [200] * 6
        assert s.backends["small1"].total == 6


def test_worker_dying_mid_stream_gives_an_in_band_error_and_done(stack):
    stack.backends["small0"].mode = "die_mid_stream"
    key = stack.tenant("die")
    with stack.client(key) as c:
        with c.stream(
            "POST", "/v1/completions", json={**BODY, "max_tokens": 10, "stream": True}
        ) as s:
            assert s.status_code == 200
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2])
    # Charged the prompt and the tokens that reached the client: the backend sent 5 before
    # dying, but those still in flight when the connection broke were never served.
    received = sum(1 for e in events[:-2] if json.loads(e).get("choices"))
    assert 0 <= received <= 5
    assert eventually(lambda: stack.charged("die") == 4 + received)


def test_client_disconnect_reaches_the_worker_and_charges_what_was_used(stack):
    backend = stack.backends["small0"]
    backend.token_delay_s = 0.02
    key = stack.tenant("gone")
    with stack.client(key) as c:
        with c.stream(
            "POST", "/v1/completions", json={**BODY, "max_tokens": 200, "stream": True}
        ) as s:
            lines = s.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data: "))
    assert eventually(lambda: backend.active == 0)
    assert backend.aborted == 1
    used = eventually(lambda: 4 + 3 <= stack.charged("gone") <= 4 + 20)
    assert used, stack.usage(key)


def test_full_queue_is_503_with_retry_after_and_deadline_never_reaches_a_worker(redis_url):
    with gateway_stack(redis_url, max_inflight_per_worker=1, queue_max_requests=1) as s:
        backend = s.backends["small0"]
        backend.token_delay_s = 0.05
        key = s.tenant("busy")
        threads = [
            threading.Thread(
                target=lambda: httpx.post(
                    f"{s.url}/v1/completions",
                    json={**BODY, "max_tokens": 20},
                    headers={"authorization": f"Bearer {key}"},
                    timeout=30,
                )
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
            time.sleep(0.1)
        with s.client(key) as c:
            r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and error_of(r)["code"] == "server_overloaded"
        assert int(r.headers["retry-after"]) >= 1
        for t in threads:
            t.join()
        # A deadline shorter than the wait: dropped in the queue, never dispatched.
        blocker = threading.Thread(
            target=lambda: httpx.post(
                f"{s.url}/v1/completions",
                json={**BODY, "max_tokens": 20},
                headers={"authorization": f"Bearer {key}"},
                timeout=30,
            )
        )
        blocker.start()
        assert eventually(lambda: backend.active == 1)  # the one slot is taken
        total_before = backend.total
        with s.client(key) as c:
            r = c.post("/v1/completions", json=BODY, headers={"x-request-timeout": "0.2"})
        assert r.status_code == 503 and error_of(r)["code"] == "deadline_exceeded"
        blocker.join()
        assert backend.total == total_before
