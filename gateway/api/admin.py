"""Admin API under /admin/, behind the admin key: tenants, their keys, routing, the fleet.
(Usage is in usage.py, classifiers and labels in learning.py.)"""

import math
from dataclasses import asdict
from typing import Any

from litestar import Request, delete, get, patch, post, put
from litestar.params import FromPath

from cascade.policy import InvalidRouting, merge_settings, settings_to_dict
from gateway.api.admin_base import AdminController, AdminUser, GatewayDep, cascade_of
from gateway.api.admin_schemas import NewKey, NewTenant, TenantBody, tenant_changes, whole_tenant
from gateway.api.bodies import read_struct
from gateway.capacity.pool import Pool
from gateway.gateway import Gateway
from quota.budget import budget_to_dict
from quota.errors import TenantNotFound
from quota.models import ApiKeyRecord, Tenant
from workers.api.types import ApiError


class TenantController(AdminController):
    """Tenants: PATCH merges, PUT replaces the whole document (admin_schemas.py)."""

    @post("/tenants", status_code=201)
    async def create_tenant(self, gw: GatewayDep, request: Request) -> dict[str, Any]:
        body = await read_struct(request, NewTenant)
        fields = whole_tenant(body.tenant_id, body, gw.pools)
        return tenant_doc(await gw.store.create_tenant(body.tenant_id, **fields))

    @get("/tenants")
    async def list_tenants(self, gw: GatewayDep) -> dict[str, Any]:
        return {"data": [tenant_doc(t) for t in await gw.store.list_tenants()]}

    @get("/tenants/{tenant_id:str}")
    async def get_tenant(self, gw: GatewayDep, tenant_id: FromPath[str]) -> dict[str, Any]:
        tenant = await gw.store.get_tenant(tenant_id)
        if tenant is None:
            raise TenantNotFound(tenant_id)
        return tenant_doc(tenant)

    @patch("/tenants/{tenant_id:str}")
    async def update_tenant(
        self, gw: GatewayDep, request: Request, tenant_id: FromPath[str]
    ) -> dict[str, Any]:
        """Merge: fields left out are left alone, `null` clears; `limits` merges per limit."""
        body = await read_struct(request, TenantBody)
        current = await gw.store.get_tenant(tenant_id)
        if current is None:
            raise TenantNotFound(tenant_id)
        changes = tenant_changes(current, body, gw.pools)
        updated = await gw.store.update_tenant(tenant_id, **changes)
        gw.keys_changed()
        return tenant_doc(updated)

    @put("/tenants/{tenant_id:str}", status_code=200)
    async def replace_tenant(
        self, gw: GatewayDep, request: Request, tenant_id: FromPath[str]
    ) -> dict[str, Any]:
        """Replace the whole document: fields left out take their defaults."""
        body = await read_struct(request, TenantBody)
        updated = await gw.store.update_tenant(tenant_id, **whole_tenant(tenant_id, body, gw.pools))
        gw.keys_changed()
        return tenant_doc(updated)

    @delete("/tenants/{tenant_id:str}", status_code=200)
    async def delete_tenant(self, gw: GatewayDep, tenant_id: FromPath[str]) -> dict[str, Any]:
        if not await gw.store.delete_tenant(tenant_id):
            raise TenantNotFound(tenant_id)
        gw.keys_changed()
        return {"deleted": tenant_id}


class KeyController(AdminController):
    """API keys: issued per tenant (the plaintext in that answer only), listed, revoked."""

    @post("/tenants/{tenant_id:str}/keys", status_code=201)
    async def create_key(
        self, gw: GatewayDep, request: Request, tenant_id: FromPath[str]
    ) -> dict[str, Any]:
        body = await read_struct(request, NewKey)
        limits = body.limits.over() if body.limits is not None else None
        budget = body.budget.budget() if body.budget is not None else None
        issued = await gw.store.create_key(tenant_id, body.name, body.expires_at, limits, budget)
        return {**tenant_doc(issued.record), "key": issued.plaintext}

    @get("/tenants/{tenant_id:str}/keys")
    async def list_keys(self, gw: GatewayDep, tenant_id: FromPath[str]) -> dict[str, Any]:
        keys = await gw.store.list_keys(tenant_id)
        used = await gw.usage.key_last_used(tenant_id) if gw.usage is not None else {}
        return {"data": [{**tenant_doc(k), "last_used_at": used.get(k.key_id)} for k in keys]}

    @delete("/keys/{key_id:str}", status_code=200)
    async def revoke_key(self, gw: GatewayDep, key_id: FromPath[str]) -> dict[str, Any]:
        if not await gw.store.revoke_key(key_id):
            raise ApiError(404, f"unknown key {key_id!r}", param="key_id", code="key_not_found")
        gw.keys_changed()
        return {"revoked": key_id}


def tenant_doc(record: Tenant | ApiKeyRecord) -> dict[str, Any]:
    """A tenant or key record as the admin API shows it: its budget in units of currency."""
    doc = asdict(record)
    doc["budget"] = budget_to_dict(record.budget)
    return doc


class PriceController(AdminController):
    """The price list per pool (`gateway.billing.book`): replaced whole by PUT, applied to
    requests admitted after it (in every gateway within a second), each change audited."""

    path = "/admin/prices"

    @get("/")
    async def get_prices(self, gw: GatewayDep) -> dict[str, Any]:
        await gw.prices.refresh(force=True)
        return gw.prices.to_dict()

    @put("/", status_code=200)
    async def put_prices(
        self, gw: GatewayDep, request: Request, who: AdminUser = "admin"
    ) -> dict[str, Any]:
        """`{"pools": {name: {prompt_per_mtok, cached_per_mtok, completion_per_mtok,
        per_compute_s, reserve_compute_s_per_token}}}`; a pool left out is free."""
        body = await read_struct(request, dict[str, Any])
        unknown = sorted(set(body) - {"pools"})
        if unknown or "pools" not in body:
            name = unknown[0] if unknown else "pools"
            raise ApiError(400, f'the body is {{"pools": {{...}}}}; {name!r} is not', param=name)
        try:
            return await gw.prices.update(body["pools"], who)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="pools", code="invalid_prices") from None

    @get("/audit")
    async def prices_audit(self, gw: GatewayDep) -> dict[str, Any]:
        return {"data": await gw.prices.audit()}


class RoutingController(AdminController):
    """The cascade's settings (`cascade.policy.RoutingSettings`, decoded strictly by
    `settings_from_dict`); each change is audited."""

    path = "/admin/routing"

    @get("/")
    async def get_routing(self, gw: GatewayDep) -> dict[str, Any]:
        return settings_to_dict(await cascade_of(gw).refresh(force=True))

    @put("/", status_code=200)
    async def put_routing(
        self, gw: GatewayDep, request: Request, who: AdminUser = "admin"
    ) -> dict[str, Any]:
        """Replace the whole settings document: fields left out take their defaults."""
        return await _store_routing(gw, request, who, merge=False)

    @patch("/", status_code=200)
    async def patch_routing(
        self, gw: GatewayDep, request: Request, who: AdminUser = "admin"
    ) -> dict[str, Any]:
        """Merge into the current settings (`cascade.policy.merge_settings`)."""
        return await _store_routing(gw, request, who, merge=True)

    @get("/audit")
    async def routing_audit(self, gw: GatewayDep) -> dict[str, Any]:
        return {"data": await cascade_of(gw).audit()}


async def _store_routing(gw: Gateway, request: Request, who: str, merge: bool) -> dict[str, Any]:
    router = cascade_of(gw)
    body = await read_struct(request, dict[str, Any])
    known = {t.tenant_id for t in await gw.store.list_tenants()}
    try:
        if merge:
            body = merge_settings(settings_to_dict(await router.refresh(force=True)), body)
        new = await router.update(body, known, who)
    except InvalidRouting as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_routing") from None
    return settings_to_dict(new)


class FleetController(AdminController):
    @get("/fleet")
    async def fleet(self, gw: GatewayDep) -> dict[str, Any]:
        """Per pool: the gateway's queue, its workers, the live view (/dashboard) and the
        capacity model with its decisions (`capacity`)."""
        extra = gw.fleet_status() if gw.fleet_status is not None else {}
        return {
            name: {
                "waiting": pool.controller.num_waiting,
                "workers": pool.snapshot(),
                # Streams' TTFT over the last minute, output tokens per second over the
                # last 10 s, ready replicas.
                "ttft_p50_s": pool.ttft_quantile_s(0.5),
                "ttft_p99_s": pool.ttft_quantile_s(0.99),
                "tokens_per_s": round(pool.tokens_per_s(), 2),
                "ready_replicas": sum(v.state == "ready" for v in pool.views.values()),
                "capacity": _capacity(pool),
                "membership": _membership(gw, name),
                **extra.get(name, {}),
            }
            for name, pool in gw.pools.items()
        }


def _membership(gw: Gateway, pool: str) -> dict[str, Any] | None:
    """Whether the pool takes members from the fleet's Redis, and the bound on how long a
    dead member stays in the rotation (None: membership is off). Each worker's `origin`
    (config, local, joined) is in `workers`."""
    watcher = gw.membership
    if watcher is None:
        return None
    return {
        "from_redis": pool in watcher.watched,
        "staleness_bound_s": watcher.staleness_bound_s,
        "fingerprint": watcher.pool_fingerprints.get(pool),  # its members' model
    }


def _capacity(pool: Pool) -> dict[str, Any]:
    """What admission reasons over and what it decided: the targets (None: none), the TTFT
    predicted for a typical request arriving now (None: no capacity model), refusals by
    reason and goodput since start (`gateway.capacity.goodput`), and each worker's model
    as its /load reports it (None: not reported)."""
    predicted = pool.typical_ttft_s()
    return {
        "ttft_target_s": pool.ttft_target_s,
        "itl_target_s": pool.itl_target_s,
        "predicted_ttft_s": None if predicted is None else round(predicted, 4),
        "completion_ratio": round(pool.completion_ratio, 3),
        "refusals": dict(pool.refusals),
        "served": pool.goodput.served,
        "goodput": pool.goodput.met,
        "workers": [
            {
                "url": v.url,
                "seats": v.seats,
                "decode_step_s": _finite(v.decode_step_s),
                "prefill_tokens_per_s": _finite(v.prefill_tokens_per_s),
                "step_s": _finite(v.step_s),
                "itl_target_s": _finite(v.itl_target_s),
            }
            for v in pool.views.values()
        ],
    }


def _finite(value: float | None) -> float | None:
    """A worker's number as JSON carries it: None for one that is not finite."""
    return value if value is not None and math.isfinite(value) else None
