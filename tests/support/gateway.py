"""A real gateway (in a thread, real HTTP, a fresh Redis) in front of given worker URLs,
with one tenant and its key: for tests whose subject is what a gateway does to a real
worker's traffic."""

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.runtime.main import build_gateway
from tests.support.redis_server import redis_url as start_redis
from tests.support.servers import serving

ADMIN = "admin-test-gateway"


@dataclass
class FrontGateway:
    url: str
    gateway: Any  # the in-process Gateway
    key: str  # tenant "t"'s API key

    def client(self, timeout_s: float = 60.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {self.key}"}, timeout=timeout_s
        )


@contextmanager
def gateway_in_front(pools: dict[str, list[str]], **config: Any) -> Iterator[FrontGateway]:
    """`pools` (name -> worker URLs) behind a gateway of `config` (GatewayConfig fields)."""
    import redis

    with start_redis() as redis_url, tempfile.TemporaryDirectory() as data_dir:
        redis.Redis.from_url(redis_url).flushdb()
        cfg = GatewayConfig(pools=pools, data_dir=data_dir, admin_key=ADMIN, **config)
        gw = build_gateway(cfg, redis_url)
        with serving(create_gateway_app(gw)) as url:
            admin = {"authorization": f"Bearer {ADMIN}"}
            r = httpx.post(f"{url}/admin/tenants", json={"tenant_id": "t"}, headers=admin)
            assert r.status_code == 201, r.text
            r = httpx.post(f"{url}/admin/tenants/t/keys", json={"name": "k"}, headers=admin)
            assert r.status_code == 201, r.text
            yield FrontGateway(url, gw, r.json()["key"])
