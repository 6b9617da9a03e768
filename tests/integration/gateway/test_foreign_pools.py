"""Pools of foreign servers behind the gateway, over real HTTP: a vLLM-shaped server (the fake
backend speaking vLLM's /metrics and /v1/models) and the `openai` kind in front of a second
gateway behind a tenant key. What the gateway sends them, what it reads from them, its
retries on their overload answers, and the upstream key kept out of everything it shows."""

import json
import logging
import tempfile

import httpx
import pytest

from gateway.app import create_gateway_app
from gateway.config import GatewayConfig, UpstreamConfig
from gateway.runtime.main import build_gateway
from tests.integration.gateway.conftest import ADMIN, gateway_stack
from tests.support.servers import serving
from tests.support.waiting import eventually

UPSTREAM_KEY = "sk-upstream-7f3a9c"
BODY = {"model": "large", "prompt": "hello there", "max_tokens": 4}


def _view(s, pool: str) -> dict:
    with s.admin() as a:
        fleet = a.get("/admin/fleet").json()
    return fleet


def _ready(s, pool: str) -> bool:
    views = s.gateway.pools[pool].views.values()
    return bool(views) and all(v.state == "ready" for v in views)


@pytest.fixture
def vllm_stack(redis_url, monkeypatch):
    monkeypatch.setenv("SY_TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    up = UpstreamConfig(kind="vllm", api_key_env="SY_TEST_UPSTREAM_KEY", model="org/llama-3-8b")
    with gateway_stack(
        redis_url,
        backend_options={"large": {"flavour": "vllm", "api_key": UPSTREAM_KEY}},
        upstreams={"large": up},
    ) as s:
        assert eventually(lambda: _ready(s, "large"))
        yield s


def test_a_vllm_pool_is_probed_on_its_own_endpoints_and_sent_only_what_it_takes(vllm_stack, caplog):
    s = vllm_stack
    caplog.set_level(logging.DEBUG)
    backend = s.backends["large0"]
    view = next(iter(s.gateway.pools["large"].views.values()))
    assert (view.kind, view.max_model_len, view.kv_total_tokens) == ("vllm", 4096, 0)
    key = s.tenant("acme")
    with s.client(key) as c:
        r = c.post("/v1/completions", json={**BODY, "top_k": 5, "priority": 1})
        assert r.status_code == 200, r.text
        sent = backend.bodies[-1]
        # Its own name for the model, the tenant's cache salt (vLLM namespaces its prefix
        # cache by it), and no priority (vLLM refuses one outside priority scheduling).
        assert sent["model"] == "org/llama-3-8b" and sent["top_k"] == 5
        assert sent["cache_salt"] and "priority" not in sent
        assert r.headers["x-switchyard-model"] == "large"
        # A stream gets usage upstream for the charge, and the client sees none it did not ask.
        with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as st:
            events = [x[6:] for x in st.iter_lines() if x.startswith("data: ")]
        assert backend.bodies[-1]["stream_options"] == {"include_usage": True}
        assert events[-1] == "[DONE]"
        assert not any("usage" in json.loads(e) for e in events[:-1])
        # Its context length, read from /v1/models, bounds what is accepted.
        too_long = c.post("/v1/completions", json={**BODY, "max_tokens": 4096})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert backend.unauthorized == 0
    assert eventually(lambda: s.charged("acme") == 2 * (2 + 4))  # its usage: 2 prompt + 4 each
    # The key never shows: not in the admin's fleet view, the metrics or the logs.
    shown = json.dumps(_view(s, "large")) + httpx.get(f"{s.url}/metrics").text + caplog.text
    assert UPSTREAM_KEY not in shown


def test_an_overload_in_a_foreign_streams_first_event_is_retried_not_relayed(vllm_stack):
    s = vllm_stack
    backend = s.backends["large0"]
    backend.mode = "busy_first_event"
    key = s.tenant("busy")
    before = len(backend.bodies)
    with s.client(key) as c:
        r = c.post("/v1/completions", json={**BODY, "stream": True})
        # Every try (one replica: the same one again) refused in its first event: the
        # client gets the refusal's status before any token, with Retry-After.
        assert r.status_code == 503, r.text
        assert "retry-after" in r.headers and r.json()["error"]["type"]
        assert len(backend.bodies) - before == s.gateway.config.dispatch_attempts
        backend.mode = "ok"
        with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as st:
            events = [x[6:] for x in st.iter_lines() if x.startswith("data: ")]
        assert st.status_code == 200 and events[-1] == "[DONE]"
        assert sum(1 for e in events[:-1] if json.loads(e).get("choices")) == 4
    assert eventually(lambda: s.charged("busy") == 2 + 4)  # the refused tries cost nothing


def test_the_openai_kind_fronts_another_gateway_with_its_key(redis_url, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    with gateway_stack(redis_url) as far:
        far_key = far.tenant("upstream-account")
        monkeypatch.setenv("SY_TEST_HOSTED_KEY", far_key)
        up = UpstreamConfig(kind="openai", api_key_env="SY_TEST_HOSTED_KEY", model="small")
        with tempfile.TemporaryDirectory() as data_dir:
            cfg = GatewayConfig(
                pools={"hosted": [far.url]},
                upstreams={"hosted": up},
                admin_key=ADMIN,
                data_dir=data_dir,
                load_poll_interval_s=0.05,
                door=False,
            )
            # Both gateways share the one Redis: tenants are told apart by their ids.
            near_gw = build_gateway(cfg, redis_url)
            with serving(create_gateway_app(near_gw)) as near_url:
                assert eventually(
                    lambda: all(v.state == "ready" for v in near_gw.pools["hosted"].views.values())
                )
                with httpx.Client(
                    base_url=near_url, headers={"authorization": f"Bearer {ADMIN}"}
                ) as admin:
                    admin.post("/admin/tenants", json={"tenant_id": "near", "limits": {}})
                    near_key = admin.post("/admin/tenants/near/keys", json={"name": "t"}).json()
                with httpx.Client(
                    base_url=near_url,
                    headers={"authorization": f"Bearer {near_key['key']}"},
                    timeout=30,
                ) as c:
                    body = {"model": "hosted", "messages": [{"role": "user", "content": "hi"}]}
                    r = c.post("/v1/chat/completions", json={**body, "max_tokens": 3})
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["message"]["content"] == "sss"  # far's small
                    # A hosted API takes OpenAI's fields only: an extra is refused here,
                    # naming it, and never reaches the upstream.
                    seen = far.backends["small0"].total
                    bad = c.post("/v1/chat/completions", json={**body, "top_k": 3})
                    assert bad.status_code == 400
                    assert bad.json()["error"]["param"] == "top_k"
                    assert far.backends["small0"].total == seen
                    fleet = httpx.get(
                        f"{near_url}/admin/fleet", headers={"authorization": f"Bearer {ADMIN}"}
                    ).text
            # The near gateway's request was charged to the far tenant its key belongs to.
            assert eventually(lambda: far.charged("upstream-account") > 0)
            assert far_key not in fleet and far_key not in caplog.text


def test_a_hosted_pool_is_held_to_its_provider_budget_and_its_word(redis_url):
    up = UpstreamConfig(kind="openai", tokens_per_minute=30)
    hosted = {"large": {"flavour": "vllm"}}  # it answers /v1/models, as a hosted API does
    with gateway_stack(redis_url, backend_options=hosted, upstreams={"large": up}) as s:
        assert eventually(lambda: _ready(s, "large"))
        key = s.tenant("hosted")
        with s.client(key) as c:
            # A request counts its prompt and its max_tokens (10), as providers count them:
            # two fit in 30 tokens a minute, a third does not.
            body = {**BODY, "max_tokens": 10}
            assert c.post("/v1/completions", json=body).status_code == 200
            assert c.post("/v1/completions", json=body).status_code == 200
            over = c.post("/v1/completions", json=body)
            assert over.status_code == 503, over.text
            assert over.json()["error"]["code"] == "upstream_rate_limited"
            assert 50 <= float(over.headers["retry-after"]) <= 62  # until the minute frees
            assert s.backends["large0"].total == 2  # the third never reached the provider
        pool = s.gateway.pools["large"]
        assert pool.refusals == {"provider": 1}

    up = UpstreamConfig(kind="openai")
    with gateway_stack(redis_url, backend_options=hosted, upstreams={"large": up}) as s:
        assert eventually(lambda: _ready(s, "large"))
        s.backends["large0"].answer_headers = {
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "20s",
        }
        key = s.tenant("told")
        with s.client(key) as c:
            assert c.post("/v1/completions", json=BODY).status_code == 200
            told = c.post("/v1/completions", json=BODY)
            assert (
                told.status_code == 503 and told.json()["error"]["code"] == "upstream_rate_limited"
            )
            assert "no requests left" in told.json()["error"]["message"]
            assert 19 <= float(told.headers["retry-after"]) <= 22
        assert s.backends["large0"].total == 1


def test_escalation_is_refused_for_a_small_pool_whose_kind_gives_no_logprobs(redis_url):
    # Detected, not configured: the small pool's members turn out to be Ollama servers.
    with gateway_stack(
        redis_url,
        backend_options={"small": {"flavour": "ollama"}},
        upstreams={"small": UpstreamConfig(kind="auto")},
        cascade_small_pool="small",
        cascade_large_pool="large",
    ) as s:
        assert eventually(lambda: _ready(s, "small"))
        assert s.gateway.pools["small"].kind == "ollama"
        s.tenant("esc")
        with s.admin() as a:
            on = {"escalation": {"esc": {"enabled": True, "min_mean_logprob": -1.0}}}
            r = a.put("/admin/routing", json=on)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["code"], error["param"]) == ("invalid_routing", "escalation.esc.enabled")
            assert "ollama" in error["message"]
            assert a.put("/admin/routing", json={"default_threshold": 0.5}).status_code == 200
