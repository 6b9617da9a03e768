"""The admin API's tenant documents, checked field by field before anything is stored.

`PATCH` merges: a field left out is left alone, `null` clears it (a limit to unlimited,
`allowed_models` to every pool, `name` to the tenant id, `allow_overflow` to true); `limits`
merges per limit. `PUT` replaces the whole document: every field left out takes its default.
Types are strict: `"false"` is not a boolean and `"100"` is not a limit.
"""

from collections.abc import Collection
from dataclasses import asdict
from typing import Any

from quota.models import Tenant, TenantLimits
from workers.api.types import ApiError

LIMIT_FIELDS = tuple(TenantLimits.__dataclass_fields__)
TENANT_FIELDS = ("name", "limits", "allowed_models", "allow_overflow")


def _limit(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ApiError(
            400, f"limits.{name} must be a positive integer or null", param=f"limits.{name}"
        )
    return value


def limits_of(raw: Any, base: TenantLimits | None = None) -> TenantLimits:
    """`raw` over `base` (None: all unlimited); `null` = every limit unlimited."""
    if raw is None:
        return TenantLimits()
    if not isinstance(raw, dict):
        raise ApiError(400, "limits must be an object", param="limits")
    unknown = sorted(set(raw) - set(LIMIT_FIELDS))
    if unknown:
        raise ApiError(
            400,
            f"unknown limit {unknown[0]!r}; limits are {', '.join(LIMIT_FIELDS)}",
            param=f"limits.{unknown[0]}",
        )
    merged = asdict(base) if base is not None else {}
    merged.update({k: _limit(k, v) for k, v in raw.items()})
    return TenantLimits(**merged)


def models_of(raw: Any, pools: Collection[str]) -> list[str]:
    """A list of existing pool names; `null` or [] = every pool."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(m, str) and m for m in raw):
        raise ApiError(400, "allowed_models must be a list of pool names", param="allowed_models")
    unknown = [m for m in raw if m not in pools]
    if unknown:
        raise ApiError(
            400,
            f"allowed_models: no pool named {unknown[0]!r} (pools: {', '.join(sorted(pools))})",
            param="allowed_models",
        )
    return list(dict.fromkeys(raw))


def _bool(raw: Any, param: str, default: bool) -> bool:
    if raw is None:
        return default
    if not isinstance(raw, bool):
        raise ApiError(400, f"{param} must be true or false", param=param)
    return raw


def _name(raw: Any, tenant_id: str) -> str:
    if raw is None:
        return tenant_id
    if not isinstance(raw, str) or not raw or len(raw) > 200:
        raise ApiError(400, "name must be a string of 1-200 characters", param="name")
    return raw


def check_fields(body: dict, allowed: Collection[str]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ApiError(
            400, f"unknown field {unknown[0]!r}; fields are {', '.join(allowed)}", param=unknown[0]
        )


def new_tenant(tenant_id: str, body: dict, pools: Collection[str]) -> dict[str, Any]:
    """Keyword arguments of `TenantStore.create_tenant` (and of a whole-document PUT) from a
    body holding any of TENANT_FIELDS; what is left out takes its default."""
    return {
        "name": _name(body.get("name"), tenant_id),
        "limits": limits_of(body.get("limits")),
        "allowed_models": models_of(body.get("allowed_models"), pools),
        "allow_overflow": _bool(body.get("allow_overflow"), "allow_overflow", True),
    }


def tenant_patch(current: Tenant, body: dict, pools: Collection[str]) -> dict[str, Any]:
    """Keyword arguments of `TenantStore.update_tenant` for the fields `body` names."""
    check_fields(body, TENANT_FIELDS)
    changes: dict[str, Any] = {}
    if "name" in body:
        changes["name"] = _name(body["name"], current.tenant_id)
    if "limits" in body:
        base = None if body["limits"] is None else current.limits
        changes["limits"] = limits_of(body["limits"], base)
    if "allowed_models" in body:
        changes["allowed_models"] = models_of(body["allowed_models"], pools)
    if "allow_overflow" in body:
        changes["allow_overflow"] = _bool(body["allow_overflow"], "allow_overflow", True)
    return changes
