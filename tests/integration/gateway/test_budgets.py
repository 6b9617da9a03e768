"""Money through real gateways over a real Redis, fake backends behind them: prices per
pool, budgets per tenant and key, the soft webhook, price changes audited, and exactness
across two gateway processes (what clients were told adds up to what was charged)."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from benchmarks.fake_backend import FakeBackend
from tests.integration.gateway.conftest import ADMIN, gateway_stack
from tests.integration.gateway.test_gateway_processes import gateway_group
from tests.support.servers import serving
from tests.support.waiting import eventually

# Prices large enough that a request of a few tokens costs a visible amount.
PRICES = {
    "small": {"prompt_per_mtok": 1000.0, "cached_per_mtok": 250.0, "completion_per_mtok": 4000.0},
    "large": {"prompt_per_mtok": 10000.0, "completion_per_mtok": 40000.0},
}
PROMPT = [5, 6, 7, 8]  # 4 tokens, counted exactly by the gateway and the fake alike
MAX_TOKENS = 6
# 4 x 1000/1e6 + 6 x 4000/1e6 = 0.028 per request on small, its worst case and its cost.
COST_SMALL = 0.028


def _admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)


def _tenant(url: str, tenant: str, budget: dict | None = None, key_budget: dict | None = None):
    with _admin(url) as c:
        r = c.post("/admin/tenants", json={"tenant_id": tenant, "budget": budget})
        assert r.status_code == 201, r.text
        assert r.json()["budget"] == (
            None
            if budget is None
            else {
                "window_days": None,
                "soft": None,
                "hard": None,
                "spend_target": None,
                "period": "month",
                **budget,
            }
        )
        k = c.post(f"/admin/tenants/{tenant}/keys", json={"name": "k", "budget": key_budget})
        assert k.status_code == 201, k.text
        return k.json()["key"]


def _complete(url: str, key: str, stream: bool = False) -> tuple[int, float | None, httpx.Response]:
    """(status, the cost the client was told, the response)."""
    body = {"model": "small", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream}
    headers = {"authorization": f"Bearer {key}"}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        cost = r.json()["usage"]["cost"] if r.status_code == 200 else None
        if r.status_code == 200:
            assert float(r.headers["x-switchyard-cost"]) == cost
        return r.status_code, cost, r
    body["stream_options"] = {"include_usage": True}
    told = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=30) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, None, r
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    told = chunk["usage"]["cost"]
    return r.status_code, told, r


def _usage(url: str, key: str) -> dict:
    return httpx.get(f"{url}/v1/usage", headers={"authorization": f"Bearer {key}"}).json()


def test_two_gateway_processes_never_pass_a_budget_and_charge_what_clients_were_told(
    redis_url, tmp_path: Path
):
    """40 requests at once, streamed and not, through `switchyard gateway --workers 2` on one
    Redis, near a budget that holds 10 of them: at most 10 are served, the rest refused
    with a 429 budget_exceeded and Retry-After, and the spend Redis holds equals the sum of
    the costs the clients were told (the overrun is 0: each reserved its worst case)."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    with serving(FakeBackend(name="s0")) as backend:
        config = {
            "redis_url": redis_url,
            "pools": {"small": [backend]},
            "default_pool": "small",
            "admin_key": ADMIN,
            "data_dir": str(tmp_path),
            "door": False,
            "prices": {"small": PRICES["small"]},
        }
        with gateway_group(config, tmp_path) as (url, _, _):
            key = _tenant(url, "spender", budget={"period": "day", "hard": 10 * COST_SMALL})
            with ThreadPoolExecutor(16) as pool:
                results = list(
                    pool.map(lambda i: _complete(url, key, stream=i % 2 == 1), range(40))
                )
            served = [cost for status, cost, _ in results if status == 200]
            refused = [r for status, _, r in results if status == 429]
            assert len(served) + len(refused) == 40
            assert len(served) == 10  # the budget holds exactly 10 worst cases
            for r in refused:
                err = r.json()["error"]
                assert (err["code"], err["type"]) == ("budget_exceeded", "insufficient_quota")
                assert int(r.headers["retry-after"]) >= 1
            assert all(c == pytest.approx(COST_SMALL) for c in served)
            usage = _usage(url, key)
            told = sum(served)
            assert usage["budget"]["spent"] == pytest.approx(told, abs=1e-9)
            assert usage["budget"]["spent"] <= usage["budget"]["hard"] + 1e-12
            assert usage["budget"]["remaining"] == pytest.approx(0.0, abs=1e-9)
            assert sum(row["cost"] for row in usage["data"]) == pytest.approx(told, abs=1e-9)
            assert usage["currency"] == "USD"


def test_a_key_budget_below_its_tenants_refuses_first_and_a_price_change_applies_later(
    redis_url,
):
    with gateway_stack(redis_url, prices=PRICES) as s:
        key = _tenant(s.url, "keyed", budget={"hard": 100.0}, key_budget={"hard": 2 * COST_SMALL})
        assert _complete(s.url, key)[0] == 200
        assert _complete(s.url, key)[0] == 200
        status, _, r = _complete(s.url, key)
        assert status == 429 and r.json()["error"]["code"] == "budget_exceeded"
        assert "key" in r.json()["error"]["message"]
        spent = _usage(s.url, key)["budget"]["spent"]  # the tenant's: the key's two requests
        assert spent == pytest.approx(2 * COST_SMALL)

        other = _tenant(s.url, "repriced")
        before = _complete(s.url, other)[1]
        doubled = {
            "small": {k: 2 * v for k, v in PRICES["small"].items()},
            "large": PRICES["large"],
        }
        with _admin(s.url) as c:
            r = c.put("/admin/prices", json={"pools": doubled}, headers={"x-admin-user": "ops"})
            assert r.status_code == 200 and r.json()["version"] == 1
            audit = c.get("/admin/prices/audit").json()["data"]
            assert audit[0]["who"] == "ops"
            assert audit[0]["old"]["small"]["prompt_per_mtok"] == 1000.0
            assert audit[0]["new"]["small"]["prompt_per_mtok"] == 2000.0
            bad = c.put("/admin/prices", json={"pools": {"nope": {}}})
            assert bad.status_code == 400 and "nope" in bad.json()["error"]["message"]
            negative = c.put("/admin/prices", json={"pools": {"small": {"prompt_per_mtok": -1}}})
            assert negative.status_code == 400
        after = _complete(s.url, other)[1]
        assert before == pytest.approx(COST_SMALL) and after == pytest.approx(2 * COST_SMALL)
        rows = _usage(s.url, other)["data"]
        assert sum(row["cost"] for row in rows) == pytest.approx(3 * COST_SMALL)


class Hook:
    """An ASGI endpoint that keeps what is POSTed to it."""

    def __init__(self) -> None:
        self.posts: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 (ASGI)
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.posts.append(json.loads(body))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def test_the_soft_budget_posts_the_webhook_once_and_is_counted(redis_url):
    hook = Hook()
    with (
        serving(hook) as hook_url,
        gateway_stack(redis_url, prices=PRICES, budget_webhook_url=hook_url) as s,
    ):
        key = _tenant(
            s.url, "soft", budget={"period": "month", "soft": 2.5 * COST_SMALL, "hard": 100.0}
        )
        for _ in range(5):
            assert _complete(s.url, key)[0] == 200
        assert eventually(lambda: len(hook.posts) == 1)
        (post,) = hook.posts
        assert post["event"] == "budget.soft_threshold_crossed"
        assert (post["tenant_id"], post["holder"], post["period"]) == ("soft", "tenant", "month")
        assert post["spent"] == pytest.approx(3 * COST_SMALL)
        assert post["soft"] == pytest.approx(2.5 * COST_SMALL)
        metrics = s.gateway.metrics
        assert metrics.budget_soft_crossings.labels(metrics.tenant("soft"))._value.get() == 1
        ratio = metrics.budget_spent_ratio.labels(metrics.tenant("soft"))._value.get()
        assert ratio == pytest.approx(5 * COST_SMALL / 100.0)


def test_a_bad_budget_is_a_400_naming_its_field(redis_url):
    with gateway_stack(redis_url, prices=PRICES) as s, _admin(s.url) as c:
        r = c.post(
            "/admin/tenants",
            json={"tenant_id": "t", "budget": {"period": "rolling", "hard": 5}},
        )
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "budget.window_days"
        r = c.post("/admin/tenants", json={"tenant_id": "t", "budget": {"hard": "5"}})
        assert r.status_code == 400


def test_auto_traffic_shows_what_it_cost_against_all_large_and_all_small(redis_url):
    with gateway_stack(
        redis_url,
        prices=PRICES,
        cascade_small_pool="small",
        cascade_large_pool="large",
    ) as s:
        key = _tenant(s.url, "cascade")
        headers = {"authorization": f"Bearer {key}"}
        for threshold in (0.0, 1.0):  # one to large, one to small
            body = {
                "model": "auto",
                "prompt": "hello there",
                "max_tokens": MAX_TOKENS,
                "switchyard_threshold": threshold,
            }
            r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
        savings = _usage(s.url, key)["savings"]
        assert savings["auto_requests"] == 2
        assert set(savings["share"]) == {"small", "large"}
        assert savings["all_large"] > savings["spent"] > savings["all_small"] > 0


def test_an_escalation_charges_both_attempts_and_a_shadow_run_is_the_operators(redis_url):
    """An unsure small answer re-run large: the tenant pays both attempts, and is told so;
    a sure answer shadowed on the large pool: the tenant pays the small answer only, and the
    shadow run's cost goes to the operator's metric."""
    with gateway_stack(
        redis_url, prices=PRICES, cascade_small_pool="small", cascade_large_pool="large"
    ) as s:
        key = _tenant(s.url, "esc")
        settings = {
            "default_threshold": 1.0,  # everything small
            "escalation": {"esc": {"enabled": True, "min_mean_logprob": -1.0}},
            "learning": {"esc": {"shadow_fraction": 1.0, "judge": "exact"}},
            "shadow_tokens_per_minute": 10_000,
        }
        with _admin(s.url) as a:
            assert a.put("/admin/routing", json=settings).status_code == 200
        assert eventually(lambda: s.gateway.router.settings.shadow_tokens_per_minute == 10_000)
        headers = {"authorization": f"Bearer {key}"}
        body = {"model": "auto", "prompt": PROMPT, "max_tokens": MAX_TOKENS}
        large_cost = 4 * 10000 / 1e6 + MAX_TOKENS * 40000 / 1e6
        s.backends["small0"].logprob = -5.0  # unsure: escalated
        r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.headers["x-switchyard-route"] == "escalated"
        assert r.json()["usage"]["cost"] == pytest.approx(COST_SMALL + large_cost)
        s.backends["small0"].logprob = -0.01  # sure: answered small, shadowed large
        r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.headers["x-switchyard-route"] == "classifier"
        assert r.json()["usage"]["cost"] == pytest.approx(COST_SMALL)
        metrics = s.gateway.metrics
        assert eventually(lambda: metrics.shadow_spend.labels("large")._value.get() > 0)
        assert metrics.shadow_spend.labels("large")._value.get() == pytest.approx(large_cost)
        rows = _usage(s.url, key)["data"]
        assert sum(row["cost"] for row in rows) == pytest.approx(2 * COST_SMALL + large_cost)
        savings = _usage(s.url, key)["savings"]
        assert savings["escalated"] == 1 and savings["auto_requests"] == 2


def test_a_stream_cut_short_is_charged_and_told_what_was_relayed(redis_url):
    """The worker dies half way: the tenant pays the prompt and the tokens relayed, at the
    pool's prices, and a client that asked for usage is told that cost in-band."""
    with gateway_stack(redis_url, prices=PRICES) as s:
        key = _tenant(s.url, "cut")
        s.backends["small0"].mode = "die_mid_stream"
        body = {
            "model": "small",
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"authorization": f"Bearer {key}"}
        chunks = []
        with httpx.stream(
            "POST", f"{s.url}/v1/completions", json=body, headers=headers, timeout=30
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        relayed = sum(1 for c in chunks if c.get("choices"))
        assert 0 < relayed < MAX_TOKENS
        usage = next(c["usage"] for c in chunks if c.get("usage"))
        expected = (4 * 1000 + relayed * 4000) / 1e6
        assert usage["completion_tokens"] == relayed
        assert usage["cost"] == pytest.approx(expected)
        assert eventually(lambda: sum(row["cost"] for row in _usage(s.url, key)["data"]) > 0)
        assert sum(row["cost"] for row in _usage(s.url, key)["data"]) == pytest.approx(expected)


def test_auto_sends_a_tenant_at_its_spend_target_to_the_small_pool_without_refusing(redis_url):
    """The spend target is not a limit: past it `auto` stops choosing the large pool (even
    for a request asking threshold 0), and nothing is refused."""
    large_cost = 4 * 10000 / 1e6 + MAX_TOKENS * 40000 / 1e6
    with gateway_stack(
        redis_url, prices=PRICES, cascade_small_pool="small", cascade_large_pool="large"
    ) as s:
        key = _tenant(
            s.url, "saver", budget={"period": "day", "spend_target": round(1.5 * large_cost, 6)}
        )
        headers = {"authorization": f"Bearer {key}"}
        body = {
            "model": "auto",
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "switchyard_threshold": 0.0,
        }  # every score would go large
        pools = []
        for _ in range(4):
            r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            pools.append(r.headers["x-switchyard-model"])
        # 1st: spend 0; 2nd: 0.67 of the target (under the 0.8 where saving starts);
        # 3rd on: 1.33 and more: small.
        assert pools == ["large", "large", "small", "small"]
        assert float(r.headers["x-switchyard-threshold"]) >= 1.0  # above any score
