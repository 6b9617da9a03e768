"""Usage accounting: what each finished request used, per tenant x model (x key), by hour and
by day, plus a capped log of a tenant's recent requests.

Written by reconcile.lua in the same call that settles the request's reservation
(`QuotaLimiter.reconcile(..., usage=...)`), so a request is recorded exactly when it is settled:
once, even after a lost reply, a retry on another replica or a journal replay; and a
settlement that waits in the journal through a Redis outage or a gateway restart carries its
usage record with it. A reservation swept from a dead gateway records nothing (its usage is
unknown; its reserved tokens stay charged to the quota windows).

Layout (tenant hash tag, see `quota.keyspace`):
    sy:{t}:uh:<hour>   hash "<model>|<key id>|<field>" -> int, hour = floor(unix_s / 3600)
    sy:{t}:ud:<day>    the same per UTC day, day = floor(unix_s / 86400)
    sy:{t}:recent      list of JSON lines, newest first, capped
    sy:{t}:keyuse      hash key id -> unix s of its last settled request (key last use)
Fields: n (requests), err (status >= 400), prompt, cached, completion, lat_ms (sum), cost
(money, nanos: `quota.budget`); under the pool that answered an `auto` request also auto_n,
auto_cost, auto_if_large and auto_if_small (what the same tokens would have cost all on the
large pool, all on the small one), auto_esc (escalated) and auto_over (overflowed).
"""

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import redis.asyncio

from quota.budget import NANOS
from quota.keyspace import tenant_prefix

GROUPS = ("model", "day", "hour", "key")
FIELDS = (
    "n",
    "err",
    "prompt",
    "cached",
    "completion",
    "lat_ms",
    "cost",
    "auto_n",
    "auto_cost",
    "auto_if_large",
    "auto_if_small",
    "auto_esc",
    "auto_over",
)
HOUR_S = 3600
DAY_S = 86400


@dataclass(frozen=True)
class UsageConfig:
    """How long usage is kept. `hour_retention_s`: hourly buckets (queries that need hours
    further back fall back to days); `day_retention_s`: daily buckets; `recent_max`: lines of
    the per-tenant recent-request log."""

    hour_retention_s: int = 8 * DAY_S
    day_retention_s: int = 400 * DAY_S
    recent_max: int = 200


def hour_key(tenant_id: str, hour: int) -> str:
    return f"{tenant_prefix(tenant_id)}uh:{hour}"


def day_key(tenant_id: str, day: int) -> str:
    return f"{tenant_prefix(tenant_id)}ud:{day}"


def recent_key(tenant_id: str) -> str:
    return tenant_prefix(tenant_id) + "recent"


def key_use_key(tenant_id: str) -> str:
    """Hash: key id -> unix seconds of the key's last settled request."""
    return tenant_prefix(tenant_id) + "keyuse"


@dataclass(frozen=True)
class UsagePart:
    """Tokens one attempt used on one pool (an escalated request has two parts)."""

    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_nanos: int = 0  # what it was charged, at the pool's price when it was admitted


@dataclass(frozen=True)
class AutoCost:
    """An `auto` request's cost beside what the same tokens would have cost on each pool of
    the cascade (nanos), and how it was routed."""

    cost_nanos: int
    if_large_nanos: int
    if_small_nanos: int
    escalated: bool
    overflowed: bool


def usage_record(
    *,
    request_id: str,
    key_id: str | None,
    model: str,
    route: str,
    status: int,
    latency_ms: int,
    parts: Sequence[UsagePart],
    finished_at_s: float,
    auto: AutoCost | None = None,
) -> str:
    """The JSON reconcile.lua applies: counters under `model` (who answered) and tokens under
    each part's model, in the hour and day of `finished_at_s`; one line in the recent log.
    Never holds prompt text or the key itself (only its id)."""
    key = key_id or "-"
    prompt = sum(p.prompt_tokens for p in parts)
    cached = sum(p.cached_tokens for p in parts)
    completion = sum(p.completion_tokens for p in parts)
    cost = sum(p.cost_nanos for p in parts)
    line = {
        "request_id": request_id,
        "time": round(finished_at_s, 3),
        "key_id": key,
        "model": model,
        "route": route,
        "status": status,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "latency_ms": latency_ms,
        "cost": cost / NANOS,
    }
    record: dict[str, Any] = {
        "hour": int(finished_at_s // HOUR_S),
        "day": int(finished_at_s // DAY_S),
        "model": model,
        "key": key,
        "ts": round(finished_at_s, 3),
        "err": 1 if status >= 400 else 0,
        "lat_ms": int(latency_ms),
        "parts": [
            [p.model, p.prompt_tokens, p.cached_tokens, p.completion_tokens, p.cost_nanos]
            for p in parts
        ],
        "line": _encode(line),
    }
    if auto is not None:  # absent otherwise: reconcile.lua reads any value as an auto request
        record["auto"] = [
            auto.cost_nanos,
            auto.if_large_nanos,
            auto.if_small_nanos,
            int(auto.escalated),
            int(auto.overflowed),
        ]
    # msgspec: this runs once per request (json.dumps twice cost ~4% of its CPU).
    return _encode(record)


def record_buckets(usage_json: str) -> tuple[int, int]:
    """(hour, day) of a record made by `usage_record`: which keys reconcile.lua writes."""
    doc = msgspec.json.decode(usage_json)
    return int(doc["hour"]), int(doc["day"])


def _encode(doc: dict) -> str:
    """Compact JSON text (separators "," and ":"), keys in insertion order."""
    return msgspec.json.encode(doc).decode()


# -- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class UsageRange:
    """Whole buckets covering [start_s, end_s): `granularity` "hour" or "day"."""

    granularity: str
    first: int  # first bucket index (hours or days since the epoch)
    last: int  # last bucket index, inclusive

    @property
    def bucket_s(self) -> int:
        return HOUR_S if self.granularity == "hour" else DAY_S

    @property
    def start_s(self) -> int:
        return self.first * self.bucket_s

    @property
    def end_s(self) -> int:
        return (self.last + 1) * self.bucket_s

    def buckets(self) -> range:
        return range(self.first, self.last + 1)


def choose_range(
    start_s: float, end_s: float, group_by: str, now_s: float, config: UsageConfig
) -> UsageRange:
    """Hours when grouping by hour, or when the range lies within the hourly retention;
    otherwise days. Raises ValueError for an empty or reversed range."""
    if not (math.isfinite(start_s) and math.isfinite(end_s)) or end_s <= start_s:
        raise ValueError("end must be after start")
    hourly = group_by == "hour" or (
        group_by != "day" and start_s >= now_s - config.hour_retention_s
    )
    size = HOUR_S if hourly else DAY_S
    return UsageRange(
        "hour" if hourly else "day", int(start_s // size), int(math.ceil(end_s / size)) - 1
    )


def aggregate(
    tenant_id: str, buckets: Iterable[tuple[int, dict]], rng: UsageRange, group_by: str
) -> list[dict]:
    """Rows of one tenant from its bucket hashes ((bucket index, {field: value})), grouped by
    model, key, day or hour. Each row: tenant_id, the group value, requests, errors,
    prompt/cached/completion/total tokens and mean latency (ms, of requests counted)."""
    if group_by not in GROUPS:
        raise ValueError(f"group_by must be one of {GROUPS}")
    totals: dict[str, dict[str, int]] = {}
    for bucket, fields in buckets:
        for raw_field, raw_value in fields.items():
            name = raw_field.decode() if isinstance(raw_field, bytes) else raw_field
            model, key, field = name.rsplit("|", 2)
            if group_by == "model":
                group = model
            elif group_by == "key":
                group = key
            else:
                start = bucket * rng.bucket_s
                size = HOUR_S if group_by == "hour" else DAY_S
                group = str(int(start // size) * size)
            counts = totals.setdefault(group, dict.fromkeys(FIELDS, 0))
            counts[field] = counts.get(field, 0) + int(raw_value)
    rows = []
    numeric = group_by in ("day", "hour")
    for group in sorted(totals, key=(lambda g: int(g)) if numeric else None):
        t = totals[group]
        row: dict[str, Any] = {"tenant_id": tenant_id}
        row[group_by] = int(group) if numeric else group
        row.update(
            requests=t["n"],
            errors=t["err"],
            prompt_tokens=t["prompt"],
            cached_tokens=t["cached"],
            completion_tokens=t["completion"],
            total_tokens=t["prompt"] + t["completion"],
            mean_latency_ms=round(t["lat_ms"] / t["n"]) if t["n"] else None,
            cost=t["cost"] / NANOS,
            auto_requests=t["auto_n"],
            auto_cost=t["auto_cost"] / NANOS,
            auto_cost_if_all_large=t["auto_if_large"] / NANOS,
            auto_cost_if_all_small=t["auto_if_small"] / NANOS,
            auto_escalated=t["auto_esc"],
            auto_overflowed=t["auto_over"],
        )
        rows.append(row)
    return rows


class UsageReader:
    """Reads the usage written by reconcile.lua. Raises redis errors (the caller maps them)."""

    def __init__(self, redis: "redis.asyncio.Redis", config: UsageConfig) -> None:
        self._redis = redis
        self.config = config

    async def query(self, tenant_id: str, rng: UsageRange, group_by: str) -> list[dict]:
        keyf = hour_key if rng.granularity == "hour" else day_key
        buckets = list(rng.buckets())
        async with self._redis.pipeline(transaction=False) as pipe:
            for b in buckets:
                pipe.hgetall(keyf(tenant_id, b))
            hashes = await pipe.execute()
        return aggregate(tenant_id, zip(buckets, hashes, strict=True), rng, group_by)

    async def key_last_used(self, tenant_id: str) -> dict[str, float]:
        """Key id -> unix seconds of its last settled request."""
        raw = await self._redis.hgetall(key_use_key(tenant_id))
        return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}

    async def recent(self, tenant_id: str, limit: int = 50) -> list[dict]:
        """The tenant's latest finished requests, newest first."""
        lines = await self._redis.lrange(recent_key(tenant_id), 0, max(0, limit - 1))
        return [json.loads(x) for x in lines]
