"""Admin API under /admin/, behind the admin key: tenants, keys, usage, fleet."""

import hmac
from dataclasses import asdict
from typing import Any

import msgspec
from litestar import Request, Router, delete, get, patch, post, put
from litestar.params import FromPath

from cascade.policy import InvalidRouting, merge_settings, settings_to_dict
from gateway.api.admin_schemas import (
    TENANT_FIELDS,
    check_fields,
    limits_of,
    new_tenant,
    tenant_patch,
)
from gateway.gateway import Gateway
from quota.errors import TenantNotFound
from workers.api.types import ApiError
from workers.api.validation import check_json_depth


def _require_admin(gw: Gateway, request: Request) -> None:
    key = gw.config.admin_key
    header = request.headers.get("authorization", "")
    given = header[7:].strip() if header.lower().startswith("bearer ") else ""
    if not key or not hmac.compare_digest(given.encode(), key.encode()):
        raise ApiError(401, "admin key required", code="invalid_admin_key")


_ADMIN_MAX_BODY_BYTES = 1024 * 1024
_ADMIN_MAX_JSON_DEPTH = 16


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > _ADMIN_MAX_BODY_BYTES:
        raise ApiError(413, f"request body over {_ADMIN_MAX_BODY_BYTES} bytes")
    check_json_depth(raw, _ADMIN_MAX_JSON_DEPTH)
    try:
        body = msgspec.json.decode(raw) if raw else {}
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _router(gw: Gateway):
    if gw.router is None:
        raise ApiError(
            404,
            "this gateway has no cascade (set cascade_small_pool and cascade_large_pool)",
            code="cascade_not_configured",
        )
    return gw.router


def admin_router(gw: Gateway) -> Router:
    @post("/tenants", status_code=201)
    async def create_tenant(request: Request) -> dict[str, Any]:
        _require_admin(gw, request)
        body = await _json_object(request)
        tenant_id = body.get("tenant_id")
        if not isinstance(tenant_id, str):
            raise ApiError(400, "tenant_id is required", param="tenant_id")
        check_fields(body, ("tenant_id", *TENANT_FIELDS))
        tenant = await gw.store.create_tenant(tenant_id, **new_tenant(tenant_id, body, gw.pools))
        return asdict(tenant)

    @get("/tenants")
    async def list_tenants(request: Request) -> dict[str, Any]:
        _require_admin(gw, request)
        return {"data": [asdict(t) for t in await gw.store.list_tenants()]}

    @get("/tenants/{tenant_id:str}")
    async def get_tenant(request: Request, tenant_id: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        tenant = await gw.store.get_tenant(tenant_id)
        if tenant is None:
            raise TenantNotFound(tenant_id)
        return asdict(tenant)

    @patch("/tenants/{tenant_id:str}")
    async def update_tenant(request: Request, tenant_id: FromPath[str]) -> dict[str, Any]:
        """Merge: fields left out are left alone, `null` clears; `limits` merges per limit."""
        _require_admin(gw, request)
        body = await _json_object(request)
        current = await gw.store.get_tenant(tenant_id)
        if current is None:
            raise TenantNotFound(tenant_id)
        changes = tenant_patch(current, body, gw.pools)
        updated = await gw.store.update_tenant(tenant_id, **changes)
        gw.keys_changed()
        return asdict(updated)

    @put("/tenants/{tenant_id:str}", status_code=200)
    async def replace_tenant(request: Request, tenant_id: FromPath[str]) -> dict[str, Any]:
        """Replace the whole document: fields left out take their defaults."""
        _require_admin(gw, request)
        body = await _json_object(request)
        check_fields(body, TENANT_FIELDS)
        whole = new_tenant(tenant_id, body, gw.pools)
        updated = await gw.store.update_tenant(tenant_id, **whole)
        gw.keys_changed()
        return asdict(updated)

    @delete("/tenants/{tenant_id:str}", status_code=200)
    async def delete_tenant(request: Request, tenant_id: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        if not await gw.store.delete_tenant(tenant_id):
            raise TenantNotFound(tenant_id)
        gw.keys_changed()
        return {"deleted": tenant_id}

    @post("/tenants/{tenant_id:str}/keys", status_code=201)
    async def create_key(request: Request, tenant_id: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        body = await _json_object(request)
        expires = body.get("expires_at")
        if expires is not None and not isinstance(expires, int | float):
            raise ApiError(400, "expires_at must be a unix time in seconds", param="expires_at")
        name = body.get("name")
        if name is not None and not isinstance(name, str):
            raise ApiError(400, "name must be a string", param="name")
        unknown = sorted(set(body) - {"name", "expires_at", "limits"})
        if unknown:
            raise ApiError(400, f"unknown field {unknown[0]!r}", param=unknown[0])
        # The key's own limits (a request must fit them and its tenant's); none: tenant's.
        limits = limits_of(body["limits"]) if body.get("limits") is not None else None
        issued = await gw.store.create_key(tenant_id, name, expires, limits)
        return {**asdict(issued.record), "key": issued.plaintext}

    @get("/tenants/{tenant_id:str}/keys")
    async def list_keys(request: Request, tenant_id: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        keys = await gw.store.list_keys(tenant_id)
        used = await gw.usage.key_last_used(tenant_id) if gw.usage is not None else {}
        return {"data": [{**asdict(k), "last_used_at": used.get(k.key_id)} for k in keys]}

    @delete("/keys/{key_id:str}", status_code=200)
    async def revoke_key(request: Request, key_id: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        if not await gw.store.revoke_key(key_id):
            raise ApiError(404, f"unknown key {key_id!r}", param="key_id", code="key_not_found")
        gw.keys_changed()
        return {"revoked": key_id}

    @get("/fleet")
    async def fleet(request: Request) -> dict[str, Any]:
        _require_admin(gw, request)
        extra = gw.fleet_status() if gw.fleet_status is not None else {}
        return {
            name: {
                "waiting": pool.controller.num_waiting,
                "workers": pool.snapshot(),
                # The live view (/dashboard): streams' TTFT over the last minute, output
                # tokens per second over the last 10 s, ready replicas.
                "ttft_p50_s": pool.ttft_quantile_s(0.5),
                "ttft_p99_s": pool.ttft_quantile_s(0.99),
                "tokens_per_s": round(pool.tokens_per_s(), 2),
                "ready_replicas": sum(v.state == "ready" for v in pool.views.values()),
                **extra.get(name, {}),
            }
            for name, pool in gw.pools.items()
        }

    @get("/routing")
    async def get_routing(request: Request) -> dict[str, Any]:
        _require_admin(gw, request)
        router = _router(gw)
        return settings_to_dict(await router.refresh(force=True))

    @put("/routing", status_code=200)
    async def put_routing(request: Request) -> dict[str, Any]:
        """Replace the whole settings document: fields left out take their defaults."""
        return await _store_routing(request, merge=False)

    @patch("/routing", status_code=200)
    async def patch_routing(request: Request) -> dict[str, Any]:
        """Merge into the current settings (`cascade.policy.merge_settings`)."""
        return await _store_routing(request, merge=True)

    async def _store_routing(request: Request, merge: bool) -> dict[str, Any]:
        _require_admin(gw, request)
        router = _router(gw)
        body = await _json_object(request)
        known = {t.tenant_id for t in await gw.store.list_tenants()}
        who = request.headers.get("x-admin-user", "admin")
        try:
            if merge:
                current = settings_to_dict(await router.refresh(force=True))
                body = merge_settings(current, body)
            new = await router.update(body, known, who)
        except InvalidRouting as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_routing") from None
        return settings_to_dict(new)

    @get("/routing/audit")
    async def routing_audit(request: Request) -> dict[str, Any]:
        _require_admin(gw, request)
        return {"data": await _router(gw).audit()}

    return Router(
        path="/admin",
        route_handlers=[
            create_tenant,
            list_tenants,
            get_tenant,
            update_tenant,
            replace_tenant,
            delete_tenant,
            create_key,
            list_keys,
            revoke_key,
            fleet,
            get_routing,
            put_routing,
            patch_routing,
            routing_audit,
        ],
    )
