"""Per test module: a real worker serving the tiny demo checkpoint, and a real gateway in
front of it over a real Redis, with two tenants of generous limits."""

import httpx
import pytest
import redis

from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.runtime.main import build_gateway
from tests.support.redis_server import redis_url as start_redis
from tests.support.servers import serving, wait_ready
from tests.support.worker import running_worker

ADMIN = "fuzz-admin"
LIMITS = {
    "tokens_per_minute": 10**12,
    "tokens_per_day": 10**12,
    "requests_per_minute": 10**9,
    "max_concurrent": 8,
}


@pytest.fixture(scope="module")
def gateway(worker):
    """(gateway URL, {tenant: API key})."""
    with start_redis() as url:
        redis.Redis.from_url(url).flushdb()
        config = GatewayConfig(
            pools={"small": [worker.url]},
            default_pool="small",
            admin_key=ADMIN,
            default_max_tokens=8,  # a body without max_tokens stays quick
            load_poll_interval_s=0.05,
            routing_poll_s=0.1,
        )
        with serving(create_gateway_app(build_gateway(config, url))) as gw_url:
            wait_ready(gw_url)
            yield gw_url, {t: _tenant(gw_url, t) for t in ("counted", "uncounted")}


def _tenant(url: str, tenant_id: str) -> str:
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}) as admin:
        body = {"tenant_id": tenant_id, "limits": LIMITS, "allowed_models": []}
        assert admin.post("/admin/tenants", json=body).status_code == 201
        r = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "fuzz"})
        assert r.status_code == 201, r.text
        return r.json()["key"]


@pytest.fixture(scope="module")
def worker(demo_dir):
    with running_worker(demo_dir) as w:
        yield w


@pytest.fixture(autouse=True)
def quiet_httpx():
    """One INFO line per request would bury the summary under thousands of lines."""
    import logging

    logger = logging.getLogger("httpx")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)
