"""The quota Lua scripts (`quota/lua/`), registered once on one client, with their keys and
arguments built in one place. Every call may raise redis ConnectionError or TimeoutError;
every script is safe to send again after a lost reply (see each script's header)."""

from importlib import resources
from typing import Any

import redis.asyncio
from redis.commands.core import AsyncScript

from quota import keyspace
from quota.budget import (
    SPEND_DAY_TTL_S,
    SPEND_MONTH_TTL_S,
    Budget,
    month_of_day,
    spend_windows,
)
from quota.journal import Settlement
from quota.models import TenantLimits
from quota.pipelined import PipelinedRedis
from quota.policy import (
    DAY_TTL_S,
    MINUTE_TTL_S,
    PENDING_TTL_S,
    ReserveReply,
    Windows,
    limit_arg,
    parse_reserve_reply,
)
from quota.usage import (
    UsageConfig,
    day_key,
    hour_key,
    key_use_key,
    recent_key,
    record_buckets,
)


def _script(name: str) -> str:
    return resources.files("quota").joinpath("lua", name).read_text()


class QuotaScripts:
    """reserve.lua, reconcile.lua and sweep.lua on `redis`; reserve and reconcile, the two
    every request runs, on `pipelined` where given (one shared connection, far less CPU a
    call than the pool: `quota.pipelined`)."""

    def __init__(
        self,
        redis: redis.asyncio.Redis,
        usage: UsageConfig | None = None,
        pipelined: PipelinedRedis | None = None,
    ) -> None:
        self.redis = redis
        self.usage = usage or UsageConfig()
        self.pipelined = pipelined
        self._reserve = redis.register_script(_script("reserve.lua"))
        self._reconcile = redis.register_script(_script("reconcile.lua"))
        self._sweep = redis.register_script(_script("sweep.lua"))

    async def _run(self, script: AsyncScript, keys: list, args: list) -> Any:
        if self.pipelined is not None:
            text = script.script
            source = bytes(text).decode() if isinstance(text, bytes | memoryview) else text
            return await self.pipelined.run_script(source, script.sha, keys, args)
        return await script(keys, args)

    async def reserve(
        self,
        tenant_id: str,
        limits: TenantLimits,
        request_id: str,
        tokens: int,
        windows: Windows,
        lease_ms: int,
        owner_id: str | None,
        cost_nanos: int = 0,
        budget: Budget | None = None,
    ) -> ReserveReply:
        """One reserve attempt against `windows` (see reserve.lua for the statuses).
        `owner_id`: the gateway indexing the reservation for sweeps; None: not indexed.
        `cost_nanos`: the request's worst-case cost, charged to the spend counters and
        checked against `budget`'s hard limit."""
        spend = spend_windows(windows.day, budget)
        period_id = (
            f"m{spend.month}"
            if budget is not None and budget.period == "month"
            else f"d{spend.day}"
        )
        keys = [
            keyspace.tokens_minute(tenant_id, windows.minute),
            keyspace.tokens_day(tenant_id, windows.day),
            keyspace.requests_minute(tenant_id, windows.minute),
            keyspace.concurrency(tenant_id),
            keyspace.pending(tenant_id, request_id),
            keyspace.owner_pending(owner_id or "-"),
            keyspace.spend_day(tenant_id, spend.day),
            keyspace.spend_month(tenant_id, spend.month),
            keyspace.soft_crossed(tenant_id, period_id),
            *(keyspace.spend_day(tenant_id, d) for d in spend.earlier_days),
        ]
        args = [
            windows.minute,
            windows.day,
            tokens,
            limit_arg(limits.tokens_per_minute),
            limit_arg(limits.tokens_per_day),
            limit_arg(limits.requests_per_minute),
            limit_arg(limits.max_concurrent),
            request_id,
            lease_ms,
            MINUTE_TTL_S,
            DAY_TTL_S,
            PENDING_TTL_S,
            owner_id or "",
            keyspace.pending_member(tenant_id, request_id),
            int(cost_nanos),
            limit_arg(budget.hard_nanos if budget else None),
            limit_arg(budget.soft_nanos if budget else None),
            budget.period if budget else "",
            SPEND_DAY_TTL_S,
            SPEND_MONTH_TTL_S,
            SPEND_MONTH_TTL_S,
        ]
        return parse_reserve_reply(await self._run(self._reserve, keys, args))

    async def settle(self, s: Settlement) -> bool:
        """Apply a settlement (and its usage record); False if it was already applied (or
        swept and applied)."""
        tid, rid = s.tenant_id, s.request_id
        hour, day = record_buckets(s.usage) if s.usage else (0, 0)
        keys = [
            keyspace.tokens_minute(tid, s.minute),
            keyspace.tokens_day(tid, s.day),
            keyspace.concurrency(tid),
            keyspace.pending(tid, rid),
            keyspace.swept(tid, rid),
            keyspace.charged(tid, rid),
            keyspace.owner_pending(s.owner_id or "-"),
            hour_key(tid, hour),
            day_key(tid, day),
            recent_key(tid),
            key_use_key(tid),
            keyspace.spend_day(tid, s.day),
            keyspace.spend_month(tid, month_of_day(s.day)),
        ]
        member = keyspace.pending_member(tid, rid) if s.owner_id else ""
        args = [
            s.delta_tokens,
            "checked" if s.checked else "unchecked",
            rid,
            MINUTE_TTL_S,
            DAY_TTL_S,
            PENDING_TTL_S,
            member,
            s.usage or "",
            self.usage.hour_retention_s,
            self.usage.day_retention_s,
            self.usage.recent_max,
            s.delta_cost_nanos,
            SPEND_DAY_TTL_S,
            SPEND_MONTH_TTL_S,
        ]
        return bool(await self._run(self._reconcile, keys, args))

    async def sweep(self, owner_id: str, member: str) -> bool:
        """Settle the reservation `member` ("<tenant>|<request id>") of the dead `owner_id`:
        release its slot, keep its tokens charged. False: nothing was pending."""
        tid, rid = keyspace.split_pending_member(member)
        keys = [
            keyspace.pending(tid, rid),
            keyspace.swept(tid, rid),
            keyspace.concurrency(tid),
            keyspace.owner_pending(owner_id),
        ]
        return bool(await self._sweep(keys, [rid, member, owner_id, PENDING_TTL_S]))
