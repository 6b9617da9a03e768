"""Admin API under /admin/, behind the admin key: tenants, keys, usage, fleet."""

import hmac
from dataclasses import asdict
from typing import Any

import msgspec
from litestar import Request, Router, delete, get, patch, post, put
from litestar.params import FromPath

from cascade.policy import InvalidRouting, settings_to_dict
from gateway.context import Gateway
from quota.errors import TenantNotFound
from quota.models import TenantLimits
from workers.api import ApiError, check_json_depth

_LIMIT_FIELDS = set(TenantLimits.__dataclass_fields__)


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


def _limits(raw: Any) -> TenantLimits:
    if raw is None:
        return TenantLimits()
    if not isinstance(raw, dict) or set(raw) - _LIMIT_FIELDS:
        raise ApiError(
            400, f"limits must be an object with keys from {sorted(_LIMIT_FIELDS)}", param="limits"
        )
    for k, v in raw.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ApiError(400, f"limits.{k} must be an integer or null", param=f"limits.{k}")
    return TenantLimits(**raw)


def _models(raw: Any) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(m, str) for m in raw):
        raise ApiError(400, "allowed_models must be a list of pool names", param="allowed_models")
    return raw


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
        overflow = body.get("allow_overflow", True)
        if not isinstance(overflow, bool):
            raise ApiError(400, "allow_overflow must be a boolean", param="allow_overflow")
        tenant = await gw.store.create_tenant(
            tenant_id,
            str(body.get("name") or tenant_id),
            _limits(body.get("limits")),
            _models(body.get("allowed_models")),
            overflow,
        )
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
        _require_admin(gw, request)
        body = await _json_object(request)
        changes: dict[str, Any] = {}
        if "name" in body:
            changes["name"] = str(body["name"])
        if "limits" in body:
            changes["limits"] = _limits(body["limits"])
        if "allowed_models" in body:
            changes["allowed_models"] = _models(body["allowed_models"])
        if "allow_overflow" in body:
            changes["allow_overflow"] = bool(body["allow_overflow"])
        return asdict(await gw.store.update_tenant(tenant_id, **changes))

    @delete("/tenants/{tenant_id:str}", status_code=200)
    async def delete_tenant(request: Request, tenant_id: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        if not await gw.store.delete_tenant(tenant_id):
            raise TenantNotFound(tenant_id)
        return {"deleted": tenant_id}

    @post("/tenants/{tenant_id:str}/keys", status_code=201)
    async def create_key(request: Request, tenant_id: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        body = await _json_object(request)
        expires = body.get("expires_at")
        if expires is not None and not isinstance(expires, int | float):
            raise ApiError(400, "expires_at must be a unix time in seconds", param="expires_at")
        issued = await gw.store.create_key(tenant_id, body.get("name"), expires)
        return {**asdict(issued.record), "key": issued.plaintext}

    @get("/tenants/{tenant_id:str}/keys")
    async def list_keys(request: Request, tenant_id: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        return {"data": [asdict(k) for k in await gw.store.list_keys(tenant_id)]}

    @delete("/keys/{key_id:str}", status_code=200)
    async def revoke_key(request: Request, key_id: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        if not await gw.store.revoke_key(key_id):
            raise ApiError(404, f"unknown key {key_id!r}", param="key_id", code="key_not_found")
        return {"revoked": key_id}

    @get("/usage")
    async def usage(request: Request) -> dict[str, Any]:
        _require_admin(gw, request)
        tenants = await gw.store.list_tenants()
        return {"data": {t.tenant_id: await gw.limiter.usage(t.tenant_id) for t in tenants}}

    @get("/fleet")
    async def fleet(request: Request) -> dict[str, Any]:
        _require_admin(gw, request)
        extra = gw.fleet_status() if gw.fleet_status is not None else {}
        return {
            name: {
                "waiting": pool.controller.num_waiting,
                "workers": pool.snapshot(),
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
        _require_admin(gw, request)
        router = _router(gw)
        body = await _json_object(request)
        known = {t.tenant_id for t in await gw.store.list_tenants()}
        who = request.headers.get("x-admin-user", "admin")
        try:
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
            delete_tenant,
            create_key,
            list_keys,
            revoke_key,
            usage,
            fleet,
            get_routing,
            put_routing,
            routing_audit,
        ],
    )
