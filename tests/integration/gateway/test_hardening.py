"""Hardening of the gateway's request path: bounds checked before anything runs, the
operator's fields kept the operator's, prompts counted as the worker sees them, refusals
with their real status (streams too), and nothing charged for what was not served."""

import httpx
import pytest

from benchmarks.fake_backend import VOCAB_SIZE
from tests.integration.gateway.conftest import gateway_stack
from tests.support.waiting import eventually

BODY = {"model": "small", "prompt": [5, 6, 7, 8], "max_tokens": 6}


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"seed": 2**70}, "seed"),
        ({"seed": -(2**64)}, "seed"),
        ({"top_k": 10**9}, "top_k"),
        ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
        ({"prompt": [1, 2, VOCAB_SIZE + 5]}, "prompt"),
        ({"stop": ["x"] * 50}, "stop"),
        ({"stop": ["y" * 10_000]}, "stop"),
        ({"logprobs": 10_000}, "logprobs"),
        ({"n": 17}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"min_tokens": 50}, "min_tokens"),
    ],
)
def test_out_of_range_fields_are_400_at_the_gateway_and_never_reach_a_worker(stack, extra, param):
    key = stack.tenant("t", max_concurrent=4)
    with stack.client(key) as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={**BODY, **extra, "stream": stream})
            assert r.status_code == 400, r.text
            assert error_of(r)["param"] == param
    assert stack.backends["small0"].total == 0
    usage = stack.usage(key)
    assert usage["tokens_today"] == 0 and usage["concurrent_requests"] == 0


def test_deep_nesting_and_oversized_bodies_are_4xx_not_500(stack):
    key = stack.tenant("t")
    deep = b'{"model": "small", "prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with stack.client(key) as c:
        r = c.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        huge = {"model": "small", "prompt": "x" * (2 * 1024 * 1024)}
        r = c.post("/v1/completions", json=huge)
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    with stack.admin() as a:
        r = a.post("/admin/tenants", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
    assert stack.usage(key)["tokens_today"] == 0


def test_operator_fields_are_overridden_before_the_worker_sees_them(stack):
    key = stack.tenant("acme")
    hostile = {**BODY, "cache_salt": "someone-else", "ignore_eos": True}
    with stack.client(key) as c:
        assert c.post("/v1/completions", json=hostile).status_code == 200
        assert c.post("/v1/completions", json=BODY).status_code == 200
    hostile_sent, plain_sent = list(stack.backends["small0"].bodies)[-2:]
    assert hostile_sent.get("ignore_eos", False) is False
    assert hostile_sent["cache_salt"] == plain_sent["cache_salt"] != "someone-else"


def test_a_tenant_cannot_ask_a_priority_above_its_ceiling(stack):
    """`priority` below the tenant's `priority_ceiling` (lower is more urgent) is a 403
    before anything is charged; within it, the worker gets the request's own priority."""
    key = stack.tenant("plain")
    with stack.client(key) as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={**BODY, "priority": -(2**30), "stream": stream})
            assert r.status_code == 403, r.text
            assert error_of(r)["code"] == "priority_not_allowed"
            assert error_of(r)["param"] == "priority"
        assert stack.backends["small0"].total == 0
        usage = stack.usage(key)
        assert usage["tokens_today"] == 0 and usage["concurrent_requests"] == 0
        assert c.post("/v1/completions", json={**BODY, "priority": 3}).status_code == 200
    assert stack.backends["small0"].bodies[-1]["priority"] == 3  # later is always allowed
    vip = stack.tenant("vip")
    with stack.admin() as a:
        r = a.patch("/admin/tenants/vip", json={"priority_ceiling": -1})
        assert r.status_code == 200 and r.json()["priority_ceiling"] == -1, r.text
        assert a.patch("/admin/tenants/vip", json={"priority_ceiling": 10**6}).status_code == 400
    with stack.client(vip) as c:
        assert c.post("/v1/completions", json={**BODY, "priority": -1}).status_code == 200
        assert stack.backends["small0"].bodies[-1]["priority"] == -1
        assert c.post("/v1/completions", json={**BODY, "priority": -2}).status_code == 403
    assert stack.backends["small0"].total == 2


def test_every_chat_field_counts_toward_the_context_limit(stack):
    """Padding a field the template renders (here `name`) cannot pass the context limit."""
    key = stack.tenant("t", max_context=200)
    short = {"role": "user", "content": "hi"}
    padded = {"role": "user", "content": "hi", "name": "n" * 3000}
    with stack.client(key) as c:
        ok = c.post(
            "/v1/chat/completions", json={"model": "small", "messages": [short], "max_tokens": 4}
        )
        assert ok.status_code == 200, ok.text
        r = c.post(
            "/v1/chat/completions", json={"model": "small", "messages": [padded], "max_tokens": 4}
        )
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    assert stack.backends["small0"].total == 1


@pytest.mark.parametrize("stream", [False, True])
def test_refusals_before_any_token_keep_their_real_status(redis_url, stream):
    with gateway_stack(redis_url, queue_max_requests=1, max_inflight_per_worker=1) as s:
        key = s.tenant("t", tokens_per_minute=100)
        with s.client(key) as c:
            big = c.post("/v1/completions", json={**BODY, "max_tokens": 500, "stream": stream})
            assert big.status_code == 429 and "retry-after" in big.headers
            bad = c.post("/v1/completions", json={**BODY, "seed": 2**70, "stream": stream})
            assert bad.status_code == 400
        s.backends["small0"].mode = "refuse"
        with s.client(key) as c:
            refused = c.post("/v1/completions", json={**BODY, "stream": stream})
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert error_of(refused)["code"] == "upstream_unavailable"
        assert eventually(lambda: s.charged("t") == 0)


def test_a_worker_4xx_is_relayed_not_retried_and_not_charged(redis_url):
    with gateway_stack(redis_url, replicas={"small": 2}) as s:
        key = s.tenant("t", max_concurrent=2)
        for b in s.backends.values():
            b.mode = "bad_request"
        with s.client(key) as c:
            for stream in (False, True):
                r = c.post("/v1/completions", json={**BODY, "stream": stream})
                assert r.status_code == 400 and error_of(r)["param"] == "top_k"
        assert sum(len(b.bodies) for b in s.backends.values()) == 2  # one worker each
        assert eventually(lambda: s.usage(key)["concurrent_requests"] == 0)
        assert s.usage(key)["tokens_today"] == 0


@pytest.mark.parametrize("header", ["nan", "-1", "inf", "1e999", "abc", "0"])
def test_invalid_deadline_headers_are_400_and_charge_nothing(stack, header):
    key = stack.tenant("t")
    with stack.client(key) as c:
        r = c.post("/v1/completions", json=BODY, headers={"x-request-timeout": header})
    assert r.status_code == 400 and error_of(r)["param"] == "x-request-timeout"
    assert stack.usage(key)["tokens_today"] == 0


def test_a_non_streaming_client_that_leaves_aborts_the_work_at_the_worker(stack):
    key = stack.tenant("t", max_concurrent=2)
    backend = stack.backends["small0"]
    backend.token_delay_s = 1.0  # 6 tokens: a 6 s answer
    with pytest.raises(httpx.ReadTimeout):
        with stack.client(key) as c:
            c.post("/v1/completions", json=BODY, timeout=httpx.Timeout(30, read=0.5))
    # Not a latency bound: unaborted, the answer would end at 6 s with `aborted` still 0.
    # (3 s was once too short on a loaded machine.)
    assert eventually(lambda: backend.aborted == 1 and backend.active == 0, 10.0)
    assert eventually(lambda: stack.usage(key)["concurrent_requests"] == 0)
    # Not served: the prompt the worker took in is paid, no output.
    assert stack.usage(key)["tokens_today"] == 4
