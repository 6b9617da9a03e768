"""A pool priced per compute-second, served by a real worker behind a real gateway: each
request is charged the engine seconds its worker reported (its share of every step it was
in), times the price; told to the client, equal to what its tenant's spend holds."""

import httpx
import pytest

from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.runtime.main import build_gateway
from tests.support.redis_server import redis_url as start_redis
from tests.support.servers import serving
from tests.support.waiting import eventually
from tests.support.worker import running_worker

ADMIN = "admin-compute"
PRICE_PER_S = 3.0


@pytest.fixture(scope="module")
def stack(demo_dir, tmp_path_factory):
    with running_worker(demo_dir) as worker, start_redis() as redis_url:
        import redis

        redis.Redis.from_url(redis_url).flushdb()
        cfg = GatewayConfig(
            pools={"small": [worker.url]},
            tokenizers={"small": str(demo_dir)},
            data_dir=str(tmp_path_factory.mktemp("gw")),
            admin_key=ADMIN,
            default_pool="small",
            load_poll_interval_s=0.05,
            door=False,
            prices={"small": {"per_compute_s": PRICE_PER_S, "reserve_compute_s_per_token": 0.5}},
        )
        gw = build_gateway(cfg, redis_url)
        with serving(create_gateway_app(gw)) as url:
            assert eventually(lambda: httpx.get(f"{url}/ready").status_code == 200)
            yield url


def _key(url: str, tenant: str) -> str:
    admin = {"authorization": f"Bearer {ADMIN}"}
    budget = {"period": "day", "hard": 1000.0}
    r = httpx.post(
        f"{url}/admin/tenants", json={"tenant_id": tenant, "budget": budget}, headers=admin
    )
    assert r.status_code == 201, r.text
    return httpx.post(f"{url}/admin/tenants/{tenant}/keys", json={}, headers=admin).json()["key"]


def test_a_compute_priced_request_pays_its_reported_engine_seconds(stack):
    key = _key(stack, "compute")
    headers = {"authorization": f"Bearer {key}"}
    told = []
    for max_tokens in (4, 24):
        body = {
            "model": "small",
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        r = httpx.post(f"{stack}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        seconds = usage["compute_seconds"]["prefill_s"] + usage["compute_seconds"]["decode_s"]
        assert seconds > 0
        assert usage["cost"] == pytest.approx(seconds * PRICE_PER_S, rel=1e-6, abs=1e-9)
        told.append(usage["cost"])
    assert told[1] > told[0]  # more decode steps, more engine time
    state = httpx.get(f"{stack}/v1/usage", headers=headers).json()
    assert eventually(
        lambda: httpx.get(f"{stack}/v1/usage", headers=headers).json()["budget"]["spent"] > 0
    )
    state = httpx.get(f"{stack}/v1/usage", headers=headers).json()
    assert state["budget"]["spent"] == pytest.approx(sum(told), abs=1e-9)
