"""Tenants and API keys in Redis (see `quota.keyspace` for the layout).

Records are JSON strings: created with SET NX, changed under WATCH. A tenant record carries a
random `uid`, copied into each of its key records, so a key never outlives its tenant: a tenant
deleted and created again under the same id does not inherit the old keys.
"""

import functools
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Any, ParamSpec, TypeVar

import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError

from quota import apikeys, keyspace
from quota.budget import Budget, budget_from_doc, budget_to_doc
from quota.errors import InvalidLimits, QuotaUnavailable, TenantExists, TenantNotFound
from quota.models import (
    ApiKeyRecord,
    IssuedKey,
    Tenant,
    TenantLimits,
    is_valid_tenant_id,
    validate_limits,
    validate_models,
    validate_priority_ceiling,
    validate_tenant_id,
)

STORE_RETRY_AFTER_S = 1.0


class KeepType:
    """`update_tenant(budget=KEEP)`: leave the field as it is (None removes it)."""


KEEP = KeepType()
_KEY_ID_ATTEMPTS = 8

P = ParamSpec("P")
T = TypeVar("T")


def _unavailable_on_redis_error(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Redis unreachable -> QuotaUnavailable: nothing here fails open, key lookup least of all."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise QuotaUnavailable(STORE_RETRY_AFTER_S) from exc

    return wrapper


def _tenant_from_doc(doc: dict[str, Any]) -> Tenant:
    return Tenant(
        tenant_id=doc["tenant_id"],
        name=doc["name"],
        limits=TenantLimits(**doc["limits"]),
        allowed_models=list(doc["allowed_models"]),
        allow_overflow=bool(doc["allow_overflow"]),
        priority_ceiling=int(doc.get("priority_ceiling", 0)),
        created_at=float(doc["created_at"]),
        budget=budget_from_doc(doc.get("budget")),
    )


def _key_from_doc(doc: dict[str, Any]) -> ApiKeyRecord:
    fields = ApiKeyRecord.__dataclass_fields__
    record = ApiKeyRecord(**{k: v for k, v in doc.items() if k in fields})
    if isinstance(record.limits, dict):
        record.limits = TenantLimits(**record.limits)
    if isinstance(record.budget, dict):
        record.budget = budget_from_doc(record.budget)
    return record


def _loads(raw: bytes | str | None) -> dict[str, Any] | None:
    return None if raw is None else json.loads(raw)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class TenantStore:
    """Tenant CRUD, API key issue/revoke and key authentication over one Redis client.

    Every method raises QuotaUnavailable when Redis is unreachable. `clock` gives unix seconds
    and stamps `created_at` and decides key expiry.
    """

    def __init__(self, redis: redis.asyncio.Redis, clock: Callable[[], float] = time.time) -> None:
        self._redis = redis
        self._clock = clock

    @property
    def redis(self) -> redis.asyncio.Redis:
        return self._redis

    # -- tenants ---------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def create_tenant(
        self,
        tenant_id: str,
        name: str,
        limits: TenantLimits,
        allowed_models: Sequence[str] = (),
        allow_overflow: bool = True,
        priority_ceiling: int = 0,
        budget: Budget | None = None,
    ) -> Tenant:
        """Raises InvalidLimits on a bad id, limit or model list; TenantExists if taken."""
        tenant = Tenant(
            tenant_id=validate_tenant_id(tenant_id),
            name=str(name),
            limits=validate_limits(limits),
            allowed_models=validate_models(allowed_models),
            allow_overflow=bool(allow_overflow),
            priority_ceiling=validate_priority_ceiling(priority_ceiling),
            created_at=self._clock(),
            budget=budget,
        )
        doc = {**asdict(tenant), "uid": uuid.uuid4().hex}
        if not await self._redis.set(keyspace.tenant_record(tenant_id), json.dumps(doc), nx=True):
            raise TenantExists(tenant_id)
        # A new tenant starts from nothing, whatever a late reconcile of a deleted tenant of
        # the same id left behind.
        await self._purge(tenant_id, keep={keyspace.tenant_record(tenant_id)})
        await self._redis.sadd(keyspace.TENANTS, tenant_id)
        return tenant

    @_unavailable_on_redis_error
    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        """None when no such tenant (or the id is not a valid tenant id)."""
        doc = await self._tenant_doc(tenant_id)
        return None if doc is None else _tenant_from_doc(doc)

    @_unavailable_on_redis_error
    async def list_tenants(self) -> list[Tenant]:
        """All tenants, sorted by id."""
        ids = sorted(_text(t) for t in await self._redis.smembers(keyspace.TENANTS))
        docs = await self._get_many([keyspace.tenant_record(t) for t in ids])
        return [_tenant_from_doc(d) for d in docs if d is not None]

    @_unavailable_on_redis_error
    async def update_tenant(
        self,
        tenant_id: str,
        *,
        name: str | None = None,
        limits: TenantLimits | None = None,
        allowed_models: Sequence[str] | None = None,
        allow_overflow: bool | None = None,
        priority_ceiling: int | None = None,
        budget: Budget | None | KeepType = KEEP,
    ) -> Tenant:
        """Change the fields given (None = keep). `limits` replaces all limits at once.
        `budget`: KEEP leaves it, None removes it, a Budget replaces it."""
        changes: dict[str, Any] = {}
        if name is not None:
            changes["name"] = str(name)
        if limits is not None:
            changes["limits"] = asdict(validate_limits(limits))
        if allowed_models is not None:
            changes["allowed_models"] = validate_models(allowed_models)
        if allow_overflow is not None:
            changes["allow_overflow"] = bool(allow_overflow)
        if priority_ceiling is not None:
            changes["priority_ceiling"] = validate_priority_ceiling(priority_ceiling)
        if not isinstance(budget, KeepType):
            changes["budget"] = budget_to_doc(budget)
        doc = None
        if is_valid_tenant_id(tenant_id):
            doc = await self._modify(keyspace.tenant_record(tenant_id), changes)
        if doc is None:
            raise TenantNotFound(tenant_id)
        return _tenant_from_doc(doc)

    @_unavailable_on_redis_error
    async def delete_tenant(self, tenant_id: str) -> bool:
        """Delete the tenant, its keys (they stop authenticating at once) and everything of it
        in Redis: counters, usage rows, the recent-request log, key last use, labels. A
        tenant created again with this id starts empty. False: no such tenant."""
        if not is_valid_tenant_id(tenant_id):
            return False
        existed = await self._redis.delete(keyspace.tenant_record(tenant_id))
        await self._redis.srem(keyspace.TENANTS, tenant_id)
        key_ids = [_text(k) for k in await self._redis.smembers(keyspace.tenant_keys(tenant_id))]
        for key_id in key_ids:
            await self._redis.delete(keyspace.api_key(key_id))
            await self._purge(keyspace.key_quota_id(key_id))  # the key's own quota counters
        await self._purge(tenant_id)
        return bool(existed)

    async def _purge(self, tenant_id: str, keep: frozenset[str] | set[str] = frozenset()) -> int:
        """Unlink every key under the tenant's prefix but `keep`; how many went."""
        pattern = keyspace.tenant_prefix(tenant_id) + "*"  # tenant ids hold no glob characters
        names = [
            name
            async for name in self._redis.scan_iter(match=pattern, count=500)
            if _text(name) not in keep
        ]
        for i in range(0, len(names), 500):
            await self._redis.unlink(*names[i : i + 500])
        return len(names)

    # -- keys ------------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def create_key(
        self,
        tenant_id: str,
        name: str | None = None,
        expires_at: float | None = None,
        limits: TenantLimits | None = None,
        budget: Budget | None = None,
    ) -> IssuedKey:
        """Issue a key. `expires_at`: unix seconds, None = never. `limits`: the key's own
        limits (see ApiKeyRecord), None = the tenant's only. Raises TenantNotFound, or
        InvalidLimits for a bad limit."""
        if limits is not None:
            limits = validate_limits(limits)
        if expires_at is not None and (
            not isinstance(expires_at, int | float)
            or isinstance(expires_at, bool)
            or not math.isfinite(expires_at)
        ):
            raise InvalidLimits("expires_at must be unix seconds or null", param="expires_at")
        if expires_at is not None and expires_at <= self._clock():
            raise InvalidLimits(
                "expires_at is in the past: the key would never authenticate", param="expires_at"
            )
        tenant = await self._tenant_doc(tenant_id)
        if tenant is None:
            raise TenantNotFound(tenant_id)
        for _ in range(_KEY_ID_ATTEMPTS):
            key_id = apikeys.new_key_id()
            plaintext = apikeys.format_key(key_id, apikeys.new_secret())
            salt = apikeys.new_salt()
            record = ApiKeyRecord(
                key_id=key_id,
                tenant_id=tenant_id,
                prefix=apikeys.visible_prefix(key_id),
                name=None if name is None else str(name),
                created_at=self._clock(),
                expires_at=None if expires_at is None else float(expires_at),
                revoked=False,
                limits=limits,
                budget=budget,
            )
            doc = {
                **asdict(record),
                "tenant_uid": tenant["uid"],
                "salt": salt,
                "hash": apikeys.hash_key(salt, plaintext),
            }
            if await self._redis.set(keyspace.api_key(key_id), json.dumps(doc), nx=True):
                await self._redis.sadd(keyspace.tenant_keys(tenant_id), key_id)
                return IssuedKey(record=record, plaintext=plaintext)
        raise RuntimeError("could not find a free API key id")  # 8 collisions in 2**32: a bug

    @_unavailable_on_redis_error
    async def list_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        """The tenant's keys (revoked and expired included), oldest first."""
        if await self._tenant_doc(tenant_id) is None:
            raise TenantNotFound(tenant_id)
        ids = [_text(k) for k in await self._redis.smembers(keyspace.tenant_keys(tenant_id))]
        docs = await self._get_many([keyspace.api_key(k) for k in ids])
        records = [_key_from_doc(d) for d in docs if d is not None]
        return sorted(records, key=lambda r: (r.created_at, r.key_id))

    @_unavailable_on_redis_error
    async def revoke_key(self, key_id: str) -> bool:
        """Mark the key revoked; takes effect on the next authenticate. False: unknown key."""
        if not isinstance(key_id, str) or not key_id.isalnum():
            return False
        return await self._modify(keyspace.api_key(key_id), {"revoked": True}) is not None

    @_unavailable_on_redis_error
    async def authenticate(self, plaintext: str) -> tuple[ApiKeyRecord, Tenant] | None:
        """The key's record and tenant; None when the key is malformed, unknown, wrong, revoked,
        expired (by `clock`) or its tenant is gone. Never cached; raises QuotaUnavailable when
        Redis is unreachable (never fails open)."""
        parsed = apikeys.parse_key(plaintext)
        if parsed is None:
            return None
        doc = _loads(await self._redis.get(keyspace.api_key(parsed.key_id)))
        if doc is None or not apikeys.key_matches(doc["salt"], doc["hash"], parsed.plaintext):
            return None
        record = _key_from_doc(doc)
        if record.revoked or apikeys.is_expired(record.expires_at, self._clock()):
            return None
        tenant = await self._tenant_doc(record.tenant_id)
        if tenant is None or tenant["uid"] != doc["tenant_uid"]:
            return None
        return record, _tenant_from_doc(tenant)

    # -- helpers ---------------------------------------------------------------------------

    async def _tenant_doc(self, tenant_id: str) -> dict[str, Any] | None:
        if not is_valid_tenant_id(tenant_id):
            return None
        return _loads(await self._redis.get(keyspace.tenant_record(tenant_id)))

    async def _get_many(self, keys: list[str]) -> list[dict[str, Any] | None]:
        # One GET per key in a plain pipeline: the keys may sit on different cluster slots.
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(key)
            return [_loads(raw) for raw in await pipe.execute()]

    async def _modify(self, key: str, changes: dict[str, Any]) -> dict[str, Any] | None:
        """Merge `changes` into the JSON record at `key` under WATCH; None if it is missing."""
        async with self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    doc = _loads(await pipe.get(key))
                    if doc is None:
                        return None
                    doc.update(changes)
                    pipe.multi()
                    pipe.set(key, json.dumps(doc))
                    await pipe.execute()
                    return doc
                except WatchError:
                    continue
