"""Usage over HTTP: `GET /v1/usage` (the calling tenant's own) and `GET /admin/usage` (every
tenant, JSON or CSV), both with `start`, `end` and `group_by`, plus the current windows.

`start`/`end`: unix seconds or ISO 8601 (a date is midnight UTC); default the last 7 days.
`group_by`: model | day | hour | key (default day). The range is widened to whole buckets
(hours, or days once it reaches past the hourly retention) and the answer says which.
"""

import csv
import io
import time
from datetime import UTC, datetime
from typing import Any

from litestar import Request, Response, get

from gateway.api.admin_base import AdminController, GatewayDep
from gateway.gateway import Gateway
from gateway.serving.intake import authenticate_key
from quota.budget import budget_state
from quota.errors import QuotaUnavailable
from quota.limiter import REDIS_DOWN
from quota.usage import DAY_S, GROUPS, UsageRange, UsageReader, choose_range
from workers.api.types import ApiError

DEFAULT_RANGE_S = 7 * DAY_S
MAX_RANGE_S = 400 * DAY_S
MAX_RECENT = 200
CSV_COLUMNS = (
    "requests",
    "errors",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "total_tokens",
    "mean_latency_ms",
    "cost",
    "auto_requests",
    "auto_cost",
    "auto_cost_if_all_large",
    "auto_cost_if_all_small",
    "auto_escalated",
    "auto_overflowed",
)


# The times a query may name: from the epoch to the last second of year 9999 (UTC).
MIN_TIME_S, MAX_TIME_S = 0.0, 253_402_300_799.0


def parse_time(raw: str | None, param: str) -> float | None:
    """Unix seconds or ISO 8601 (naive = UTC), between the epoch and year 9999; 400
    otherwise (`nan`, `inf` and `1e300` included)."""
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = _iso_time(raw, param)
    if not MIN_TIME_S <= value <= MAX_TIME_S:  # false for nan
        raise ApiError(
            400,
            f"{param} must be a time between 1970 and 9999 (unix seconds or ISO 8601)",
            param=param,
        )
    return value


def _iso_time(raw: str, param: str) -> float:
    try:
        parsed = datetime.fromisoformat(raw.replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        return parsed.timestamp()
    except (ValueError, OverflowError):
        raise ApiError(
            400, f"{param} must be unix seconds or an ISO 8601 date/time", param=param
        ) from None


def usage_range(request: Request, reader: UsageReader) -> tuple[UsageRange, str]:
    """The query's buckets and grouping; 400 for a bad parameter."""
    params = request.query_params
    group_by = params.get("group_by") or "day"
    if group_by not in GROUPS:
        raise ApiError(400, f"group_by must be one of {', '.join(GROUPS)}", param="group_by")
    now = time.time()
    end = parse_time(params.get("end"), "end")
    end = now if end is None else end
    start = parse_time(params.get("start"), "start")
    start = end - DEFAULT_RANGE_S if start is None else start
    if end <= start:
        raise ApiError(400, "end must be after start", param="end")
    if end - start > MAX_RANGE_S:
        raise ApiError(
            400, f"the range may span at most {MAX_RANGE_S // DAY_S} days", param="start"
        )
    if group_by == "hour" and end - start > reader.config.hour_retention_s + DAY_S:
        raise ApiError(
            400,
            "group_by=hour reaches back at most the hourly retention "
            f"({reader.config.hour_retention_s // 3600} h); use group_by=day",
            param="group_by",
        )
    return choose_range(start, end, group_by, now, reader.config), group_by


def _recent_limit(request: Request, default: int) -> int:
    raw = request.query_params.get("recent")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_RECENT:  # not "²"
        raise ApiError(400, f"recent must be an integer in 0..{MAX_RECENT}", param="recent")
    return int(raw)


def _period(rng: UsageRange, group_by: str) -> dict[str, Any]:
    return {
        "start": rng.start_s,
        "end": rng.end_s,
        "granularity": rng.granularity,
        "group_by": group_by,
    }


# A spreadsheet reads a cell starting with one of these as a formula (`-2-3` is -5, `=...`
# runs), or strips it (tab, CR) and then may; such a cell gets a leading `'`.
_FORMULA_START = ("-", "=", "+", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    """One CSV cell: None is empty, text that a spreadsheet would take for a formula is
    prefixed with `'`; numbers are left as numbers."""
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def to_csv(rows: list[dict], group_by: str) -> str:
    """The rows as CSV, every cell through `csv_cell` (ids, model and key names included).
    Text in the rows is always quoted, so a CR or newline in a name cannot start a row of its
    own; the header (our own column names, from GROUPS and CSV_COLUMNS) is plain."""
    out = io.StringIO()
    out.write(",".join(("tenant_id", group_by, *CSV_COLUMNS)) + "\n")
    writer = csv.writer(out, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)
    for row in rows:
        cells = (row["tenant_id"], row[group_by], *(row[c] for c in CSV_COLUMNS))
        writer.writerow(tuple(csv_cell(c) for c in cells))
    return out.getvalue()


def savings(by_model: list[dict]) -> dict[str, Any] | None:
    """For `auto` traffic in the range: how many requests, what they cost, what the same
    tokens would have cost all on the large pool and all on the small one, and the share
    each pool answered (rows grouped by model). None when there was none."""
    auto = [row for row in by_model if row.get("auto_requests")]
    total = sum(row["auto_requests"] for row in auto)
    if not total:
        return None
    return {
        "auto_requests": total,
        "spent": sum(row["auto_cost"] for row in auto),
        "all_large": sum(row["auto_cost_if_all_large"] for row in auto),
        "all_small": sum(row["auto_cost_if_all_small"] for row in auto),
        "escalated": sum(row["auto_escalated"] for row in auto),
        "overflowed": sum(row["auto_overflowed"] for row in auto),
        "share": {row["model"]: row["auto_requests"] / total for row in auto},
    }


def need_reader(gw: Gateway) -> UsageReader:
    if gw.usage is None:
        raise ApiError(404, "this gateway keeps no usage history", code="usage_not_enabled")
    return gw.usage


def usage_routes(gw: Gateway) -> list:
    """`GET /v1/usage`, for the caller's own tenant."""

    @get("/v1/usage")
    async def tenant_usage(request: Request) -> dict[str, Any]:
        _, tenant = await authenticate_key(gw, request)
        r = need_reader(gw)
        rng, group_by = usage_range(request, r)
        recent = _recent_limit(request, 20)
        try:
            rows = await r.query(tenant.tenant_id, rng, group_by)
            lines = await r.recent(tenant.tenant_id, recent) if recent else []
            by_model = (
                rows if group_by == "model" else await r.query(tenant.tenant_id, rng, "model")
            )
        except REDIS_DOWN as exc:
            raise QuotaUnavailable(1.0) from exc
        current = await gw.limiter.usage(tenant.tenant_id)
        budget = None
        if tenant.budget is not None:
            spent, now_s = await gw.limiter.spent(tenant.tenant_id, tenant.budget)
            budget = budget_state(tenant.budget, spent, now_s)
        return {
            "tenant_id": tenant.tenant_id,
            **current,  # the current windows, as before
            "limits": vars(tenant.limits),
            **_period(rng, group_by),
            "currency": gw.prices.currency,
            "budget": budget,
            "savings": savings(by_model),
            "data": rows,
            "recent": lines,
        }

    return [tenant_usage]


class UsageController(AdminController):
    @get("/usage")
    async def admin_usage(self, gw: GatewayDep, request: Request) -> Any:
        """Every tenant's usage (`tenant=` picks one), JSON or `format=csv`."""
        r = need_reader(gw)
        rng, group_by = usage_range(request, r)
        fmt = request.query_params.get("format") or "json"
        if fmt not in ("json", "csv"):
            raise ApiError(400, "format must be json or csv", param="format")
        wanted = request.query_params.get("tenant")
        tenants = await gw.store.list_tenants()
        if wanted:
            tenants = [t for t in tenants if t.tenant_id == wanted]
            if not tenants:
                raise ApiError(404, f"unknown tenant {wanted!r}", param="tenant", code="not_found")
        recent = _recent_limit(request, 0)
        rows: list[dict] = []
        current: dict[str, Any] = {}
        recents: dict[str, list] = {}
        try:
            for t in tenants:
                rows.extend(await r.query(t.tenant_id, rng, group_by))
                if recent:
                    recents[t.tenant_id] = await r.recent(t.tenant_id, recent)
        except REDIS_DOWN as exc:
            raise QuotaUnavailable(1.0) from exc
        if fmt == "csv":
            return Response(content=to_csv(rows, group_by), media_type="text/csv")
        for t in tenants:
            current[t.tenant_id] = {
                **(await gw.limiter.usage(t.tenant_id)),
                "limits": vars(t.limits),
            }
            if t.budget is not None:
                spent, now_s = await gw.limiter.spent(t.tenant_id, t.budget)
                current[t.tenant_id]["budget"] = budget_state(t.budget, spent, now_s)
        doc = {
            **_period(rng, group_by),
            "currency": gw.prices.currency,
            "data": rows,
            "current": current,
        }
        if recent:
            doc["recent"] = recents
        return doc
