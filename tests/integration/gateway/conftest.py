"""A real gateway (in a thread, real HTTP) over a real Redis and fake backends."""

import asyncio
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from benchmarks.fake_backend import FakeBackend
from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.runtime.main import build_gateway
from tests.support.quota_books import tokens_charged
from tests.support.redis_server import redis_url as start_redis
from tests.support.servers import serving

ADMIN = "admin-secret"


@pytest.fixture(scope="session")
def redis_url():
    with start_redis() as url:
        yield url


@dataclass
class Stack:
    url: str
    backends: dict[str, FakeBackend]
    backend_urls: dict[str, str]
    redis_url: str
    gateway: Any = None  # the in-process Gateway, when there is one

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {ADMIN}"})

    def tenant(self, tenant_id: str, **limits) -> str:
        """Create a tenant with these limits and return a fresh API key."""
        allowed = limits.pop("allowed_models", [])
        with self.admin() as c:
            r = c.post(
                "/admin/tenants",
                json={"tenant_id": tenant_id, "limits": limits, "allowed_models": allowed},
            )
            assert r.status_code == 201, r.text
            k = c.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "test"})
            assert k.status_code == 201, k.text
            return k.json()["key"]

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {key}"}, timeout=30
        )

    def usage(self, key: str) -> dict:
        with self.client(key) as c:
            return c.get("/v1/usage").json()

    def charged(self, tenant_id: str) -> int:
        """Tokens Redis holds against the tenant, in every minute window (not only the current
        one, which a passing minute boundary would reset mid-test)."""
        return tokens_charged(self.redis_url, tenant_id)


def run_on_clients(redis_url: str, wrap, body, num_clients: int = 1):  # noqa: ANN001, ANN201
    """`asyncio.run(body(*objects))` on a flushed Redis, each object `wrap(client)` over its
    own client (as from several gateways); the clients are closed after."""
    import redis.asyncio as aioredis

    _flush(redis_url)

    async def main():  # noqa: ANN202
        clients = [aioredis.Redis.from_url(redis_url) for _ in range(num_clients)]
        try:
            return await body(*[wrap(c) for c in clients])
        finally:
            for c in clients:
                await c.aclose()

    return asyncio.run(main())


def _flush(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushdb()


@contextmanager
def gateway_stack(
    redis_url: str,
    replicas: dict[str, int] | None = None,
    backend_options: dict[str, dict[str, Any]] | None = None,
    extra_pools: dict[str, list[str]] | None = None,
    **config,
):
    """Fake backends per pool (name -> replica count), a gateway in front, fresh Redis db.
    `backend_options`: per pool, FakeBackend arguments (a `flavour`, an `api_key`);
    `extra_pools`: pools of real servers already running (name -> their URLs)."""
    _flush(redis_url)
    replicas = replicas or {"small": 1, "large": 1}
    backend_options = backend_options or {}
    with ExitStack() as stack:
        backends, urls, pools = {}, {}, {}
        for pool, count in replicas.items():
            pools[pool] = []
            for i in range(count):
                name = f"{pool}{i}"
                backends[name] = FakeBackend(name=name, **backend_options.get(pool, {}))
                urls[name] = stack.enter_context(serving(backends[name]))
                pools[pool].append(urls[name])
        pools.update(extra_pools or {})
        # The door (gateway/capacity/door.py) holds over-share tenants by the others' latency,
        # which a test process (gateway, backends and clients sharing one GIL) has for
        # other reasons; it has tests of its own, so here it is off unless a test asks.
        config.setdefault("door", False)
        cfg = GatewayConfig(
            pools=pools,
            data_dir=stack.enter_context(tempfile.TemporaryDirectory(prefix="sy-gw-")),
            routing_poll_s=0.1,
            admin_key=ADMIN,
            default_pool="small",
            load_poll_interval_s=0.05,
            **config,
        )
        gw = build_gateway(cfg, redis_url)
        url = stack.enter_context(serving(create_gateway_app(gw)))
        _wait_ready(url)
        yield Stack(url, backends, urls, redis_url, gw)


def _wait_ready(url: str) -> None:
    for _ in range(200):
        if httpx.get(f"{url}/ready").status_code == 200:
            return
        asyncio.run(asyncio.sleep(0.02))
    raise RuntimeError("gateway never became ready")


@pytest.fixture
def stack(redis_url):
    with gateway_stack(redis_url) as s:
        yield s
