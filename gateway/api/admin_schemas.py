"""The admin API's request bodies as msgspec Structs, decoded strictly (gateway/api/bodies.py):
`"false"` is not a boolean, `"100"` is not a limit, an unknown field is refused by name.

A field left out is `UNSET`. `PATCH` merges: a field left out is left alone, `null` clears
it (a limit to unlimited, `allowed_models` to every pool, `name` to the tenant id,
`allow_overflow` to true); `limits` merges per limit. `PUT` replaces the whole document:
every field left out takes its default. Only the pool names are checked here by hand, as
they depend on this gateway's pools.
"""

from collections.abc import Collection
from dataclasses import asdict
from typing import Annotated, Any

from msgspec import UNSET, Meta, Struct, UnsetType

from quota.budget import Budget, budget_from_dict
from quota.errors import InvalidLimits
from quota.models import MAX_LIMIT, TENANT_ID_RE, Tenant, TenantLimits
from workers.api.types import ApiError

# A limit: a positive integer (up to what Lua counts exactly), `null` = unlimited, left out
# = unchanged (PATCH) or unlimited.
Limit = Annotated[int, Meta(gt=0, le=MAX_LIMIT)] | None | UnsetType
TenantName = Annotated[str, Meta(min_length=1, max_length=200)]
PoolName = Annotated[str, Meta(min_length=1)]


class LimitsBody(Struct, forbid_unknown_fields=True):
    """A tenant's or a key's `limits` (quota.models.TenantLimits, field for field)."""

    tokens_per_minute: Limit = UNSET
    tokens_per_day: Limit = UNSET
    requests_per_minute: Limit = UNSET
    max_concurrent: Limit = UNSET
    max_context: Limit = UNSET

    def over(self, base: TenantLimits | None = None) -> TenantLimits:
        """These limits over `base` (None: every limit unlimited)."""
        merged = asdict(base) if base is not None else {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not UNSET:
                merged[name] = value
        return TenantLimits(**merged)


class BudgetBody(Struct, forbid_unknown_fields=True):
    """A tenant's or a key's money `budget` (quota.budget.Budget), amounts in units of the
    gateway's currency; it is replaced whole (a PATCH does not merge inside it)."""

    period: str = "month"  # day | month | rolling
    window_days: int | None = None  # rolling only
    hard: float | None = None  # refused past it
    soft: float | None = None  # the webhook and a metric, once per period
    spend_target: float | None = None  # `auto` saves as spend nears it

    def budget(self, where: str = "budget") -> Budget | None:
        try:
            return budget_from_dict({f: getattr(self, f) for f in self.__struct_fields__}, where)
        except InvalidLimits as exc:
            raise ApiError(400, str(exc), param=exc.param) from None


class TenantBody(Struct, forbid_unknown_fields=True):
    """`PUT` (the whole document) and `PATCH` (a merge) of /admin/tenants/{id}."""

    name: TenantName | None | UnsetType = UNSET
    limits: LimitsBody | None | UnsetType = UNSET
    allowed_models: list[PoolName] | None | UnsetType = UNSET
    allow_overflow: bool | None | UnsetType = UNSET
    # The most urgent `priority` its requests may ask (lower is more urgent); null: 0.
    priority_ceiling: int | None | UnsetType = UNSET
    budget: BudgetBody | None | UnsetType = UNSET  # null: no money budget


class NewTenant(TenantBody, forbid_unknown_fields=True, kw_only=True):
    """`POST /admin/tenants`: a whole document and the new tenant's id."""

    tenant_id: Annotated[str, Meta(pattern=TENANT_ID_RE.pattern)]


class NewKey(Struct, forbid_unknown_fields=True):
    """`POST /admin/tenants/{id}/keys`. `limits`: the key's own (a request must fit them and
    its tenant's); left out or `null`: only the tenant's apply."""

    name: str | None = None
    expires_at: float | None = None  # unix seconds; None: never expires
    limits: LimitsBody | None = None
    budget: BudgetBody | None = None  # the key's own, below its tenant's; None: none


def whole_tenant(tenant_id: str, body: TenantBody, pools: Collection[str]) -> dict[str, Any]:
    """Keyword arguments of `TenantStore.create_tenant` (and of a whole-document PUT):
    what `body` leaves out or sets to `null` takes its default."""
    return {
        "name": body.name or tenant_id,
        "limits": body.limits.over() if isinstance(body.limits, LimitsBody) else TenantLimits(),
        "allowed_models": models_of(body.allowed_models or [], pools),
        "allow_overflow": body.allow_overflow if isinstance(body.allow_overflow, bool) else True,
        "priority_ceiling": body.priority_ceiling if isinstance(body.priority_ceiling, int) else 0,
        "budget": body.budget.budget() if isinstance(body.budget, BudgetBody) else None,
    }


def tenant_changes(current: Tenant, body: TenantBody, pools: Collection[str]) -> dict[str, Any]:
    """Keyword arguments of `TenantStore.update_tenant` for the fields `body` names."""
    changes: dict[str, Any] = {}
    if body.name is not UNSET:
        changes["name"] = body.name or current.tenant_id
    if body.limits is not UNSET:
        limits = body.limits
        changes["limits"] = limits.over(current.limits) if limits is not None else TenantLimits()
    if body.allowed_models is not UNSET:
        changes["allowed_models"] = models_of(body.allowed_models or [], pools)
    if body.allow_overflow is not UNSET:
        changes["allow_overflow"] = True if body.allow_overflow is None else body.allow_overflow
    if body.priority_ceiling is not UNSET:
        ceiling = body.priority_ceiling
        changes["priority_ceiling"] = 0 if ceiling is None else ceiling
    if body.budget is not UNSET:
        changes["budget"] = body.budget.budget() if body.budget is not None else None
    return changes


def models_of(names: list[str], pools: Collection[str]) -> list[str]:
    """`names` without repeats, each an existing pool; [] = every pool."""
    unknown = [m for m in names if m not in pools]
    if unknown:
        raise ApiError(
            400,
            f"allowed_models: no pool named {unknown[0]!r} (pools: {', '.join(sorted(pools))})",
            param="allowed_models",
        )
    return list(dict.fromkeys(names))
