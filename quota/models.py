"""Tenants, their limits and API key records: plain data plus the checks on it.

Times are unix seconds (float). A limit of `None` means unlimited.
"""

import re
from dataclasses import dataclass, fields

from quota.budget import Budget
from quota.errors import InvalidLimits
from quota.keyspace import RESERVED_TENANT_PREFIXES

TENANT_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass
class TenantLimits:
    """Per-tenant limits; each `None` means unlimited."""

    tokens_per_minute: int | None = None  # prompt + max_tokens reserved per minute window
    tokens_per_day: int | None = None  # same, per UTC day
    requests_per_minute: int | None = None
    max_concurrent: int | None = None  # requests in flight at once
    max_context: int | None = None  # prompt + max_tokens of one request


@dataclass
class Tenant:
    tenant_id: str
    name: str
    limits: TenantLimits
    allowed_models: list[str]  # pool names; [] = every pool
    allow_overflow: bool = True  # may the cascade overflow this tenant to another pool
    # The most urgent `priority` its requests may ask (lower is more urgent; a class scales
    # the pool's TTFT target, gateway priority_ttft_scale). 0: the default class at best,
    # so a tenant cannot promote itself; it may always ask to be served later.
    priority_ceiling: int = 0
    created_at: float = 0.0  # unix seconds
    budget: Budget | None = None  # a spending limit in money (quota.budget); None: none


@dataclass
class ApiKeyRecord:
    """What is stored about an API key, minus its hash: safe to show to an admin."""

    key_id: str  # short random id; the plaintext is `sy-<key_id>-<secret>`
    tenant_id: str
    prefix: str  # visible prefix of the plaintext, e.g. "sy-ab12cd34"
    name: str | None
    created_at: float  # unix seconds
    expires_at: float | None  # unix seconds; None = never expires
    revoked: bool
    # The key's own limits, counted over this key's requests only, on top of its tenant's
    # (a request must fit both). None: only the tenant's limits apply.
    limits: "TenantLimits | None" = None
    # The key's own money budget, over this key's requests only, on top of its tenant's.
    budget: Budget | None = None


@dataclass
class IssuedKey:
    """A freshly created key. `plaintext` exists only here: it is shown once, never stored."""

    record: ApiKeyRecord
    plaintext: str


def is_valid_tenant_id(tenant_id: object) -> bool:
    """A well-formed id outside the reserved namespaces (a key's own quota, `key.<id>`)."""
    return (
        isinstance(tenant_id, str)
        and TENANT_ID_RE.fullmatch(tenant_id) is not None
        and not tenant_id.lower().startswith(RESERVED_TENANT_PREFIXES)
    )


def validate_tenant_id(tenant_id: object) -> str:
    """`tenant_id` if it matches TENANT_ID_RE and starts with no reserved prefix, else
    InvalidLimits(param="tenant_id")."""
    if isinstance(tenant_id, str) and tenant_id.lower().startswith(RESERVED_TENANT_PREFIXES):
        raise InvalidLimits(
            f"tenant_id may not start with {' or '.join(map(repr, RESERVED_TENANT_PREFIXES))}: "
            "that namespace is the gateway's own",
            param="tenant_id",
        )
    if not is_valid_tenant_id(tenant_id):
        raise InvalidLimits(
            "tenant_id must be 1-64 characters of letters, digits, '_', '.' or '-'",
            param="tenant_id",
        )
    assert isinstance(tenant_id, str)
    return tenant_id


MAX_LIMIT = 2**53  # Lua counts in doubles: past this, a counter no longer adds up exactly


def validate_limits(limits: TenantLimits) -> TenantLimits:
    """Every limit must be `None` or an int in [1, MAX_LIMIT]; raise
    InvalidLimits(param="limits.<f>")."""
    for f in fields(limits):
        value = getattr(limits, f.name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_LIMIT:
            raise InvalidLimits(
                f"limits.{f.name} must be a positive integer up to {MAX_LIMIT} or null, "
                f"got {value!r}",
                param=f"limits.{f.name}",
            )
    return limits


MAX_PRIORITY = 1000  # |priority_ceiling| at most this


def validate_priority_ceiling(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or abs(value) > MAX_PRIORITY:
        raise InvalidLimits(
            f"priority_ceiling must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], "
            f"got {value!r}",
            param="priority_ceiling",
        )
    return value


def validate_models(allowed_models: object) -> list[str]:
    if not isinstance(allowed_models, list | tuple) or not all(
        isinstance(m, str) and m for m in allowed_models
    ):
        raise InvalidLimits("allowed_models must be a list of pool names", param="allowed_models")
    return list(allowed_models)
