"""Stored responses (`store: true`, the Responses API's default) in Redis, one key per
response under its tenant's hash tag (`sy:{tenant}:resp:ID`), kept for the configured
retention (`GatewayConfig.responses_retention_s`). Each holds the response object and its
conversation as chat messages, so `previous_response_id` continues it with one read.

A tenant reads, continues and deletes only its own: another tenant's id is not found.
Redis unreachable is a 503 `store_unavailable` with a Retry-After (a read or a delete), never
a 500; a write that fails is the caller's to log."""

import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError

from quota import keyspace
from workers.api.types import ApiError


def key(tenant_id: str, response_id: str) -> str:
    """Under the tenant's prefix, so deleting the tenant deletes its stored responses."""
    return f"{keyspace.tenant_prefix(tenant_id)}resp:{response_id}"


T = TypeVar("T")


async def _reading(call: Awaitable[T]) -> T:
    try:
        return await call
    except (RedisError, OSError) as exc:
        raise ApiError(
            503,
            f"stored responses are unavailable ({type(exc).__name__}); retry later",
            type="server_error",
            code="store_unavailable",
            retry_after_s=1.0,
        ) from None


class ResponseStore:
    __slots__ = ("_redis", "_retention_s")

    def __init__(self, redis: Redis, retention_s: int) -> None:
        self._redis, self._retention_s = redis, retention_s

    async def save(self, tenant_id: str, response_id: str, record: bytes) -> None:
        await self._redis.set(key(tenant_id, response_id), record, ex=self._retention_s)

    async def load(self, tenant_id: str, response_id: str) -> dict[str, Any] | None:
        raw = await _reading(self._redis.get(key(tenant_id, response_id)))
        if raw is None:
            return None
        record: dict[str, Any] = json.loads(raw)
        return record

    async def delete(self, tenant_id: str, response_id: str) -> bool:
        return bool(await _reading(self._redis.delete(key(tenant_id, response_id))))

    async def history(self, tenant_id: str, response_id: str) -> list[dict[str, Any]]:
        """The chat messages that `previous_response_id` continues; 400 if it is not one
        of this tenant's stored responses (expired, deleted, never stored, or another's)."""
        record = await self.load(tenant_id, response_id)
        if record is None:
            raise ApiError(
                400,
                f"previous response `{response_id}` is not found: it was not stored, was "
                "deleted or has expired",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        conversation: list[dict[str, Any]] = record["conversation"]
        return conversation
