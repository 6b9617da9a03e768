"""The key cache: a key that authenticated within `key_cache_ttl_s` costs no Redis lookup,
and a change made elsewhere (another gateway process, the store directly) still applies
within that time; a change through this gateway's own admin API applies at once."""

import asyncio
import time

import redis.asyncio

from quota.store import TenantStore
from tests.integration.gateway.conftest import gateway_stack
from tests.support.waiting import eventually

BODY = {"model": "small", "prompt": [5, 6, 7, 8], "max_tokens": 2}
AUTH_LOOKUPS = 'switchyard_gateway_redis_latency_seconds_count{op="auth"}'


def auth_lookups(stack) -> float:  # noqa: ANN001
    with stack.admin() as a:
        for line in a.get("/metrics").text.splitlines():
            if line.startswith(AUTH_LOOKUPS):
                return float(line.split()[-1])
    return 0.0


async def revoke(redis_url: str, key_id: str) -> bool:
    r = redis.asyncio.Redis.from_url(redis_url)
    try:
        return await TenantStore(r).revoke_key(key_id)
    finally:
        await r.aclose()


def test_a_recent_key_is_not_looked_up_again_within_the_ttl(redis_url):
    with gateway_stack(redis_url, replicas={"small": 1}, key_cache_ttl_s=60.0) as s:
        key = s.tenant("acme")
        with s.client(key) as c:
            for _ in range(20):
                assert c.post("/v1/completions", json=BODY).status_code == 200
        assert auth_lookups(s) == 1


def test_a_key_revoked_behind_the_gateways_back_stops_within_the_ttl(redis_url):
    ttl_s = 0.5
    with gateway_stack(redis_url, replicas={"small": 1}, key_cache_ttl_s=ttl_s) as s:
        key = s.tenant("acme")
        with s.client(key) as c:
            assert c.post("/v1/completions", json=BODY).status_code == 200
            with s.admin() as a:
                key_id = a.get("/admin/tenants/acme/keys").json()["data"][0]["key_id"]
            # As another gateway process would: straight into Redis, not through this one.
            assert asyncio.run(revoke(redis_url, key_id))
            revoked_at = time.monotonic()
            assert eventually(
                lambda: c.post("/v1/completions", json=BODY).status_code == 401, timeout_s=5
            )
            # Within the TTL, give or take a few requests' latency on a loaded 2-core
            # machine (the default TTL would take a minute).
            assert time.monotonic() - revoked_at < ttl_s + 1.5


def test_a_change_through_this_gateways_admin_api_applies_on_the_next_request(redis_url):
    with gateway_stack(redis_url, replicas={"small": 1}, key_cache_ttl_s=60.0) as s:
        key = s.tenant("acme")
        with s.client(key) as c:
            assert c.post("/v1/completions", json=BODY).status_code == 200
            with s.admin() as a:
                r = a.patch("/admin/tenants/acme", json={"limits": {"max_context": 3}})
                assert r.status_code == 200, r.text
            assert c.post("/v1/completions", json=BODY).status_code == 400  # 4 + 2 > 3
