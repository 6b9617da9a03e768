"""`switchyard admin`: request bodies from flags, and answers as readable tables."""

import argparse
import time
from typing import Any

LIMITS = ("tokens_per_minute", "tokens_per_day", "requests_per_minute", "max_concurrent",
          "max_context")  # fmt: skip
_CLEARABLE = {*LIMITS, "allowed_models", "name", "allow_overflow", "priority_ceiling"}


def tenant_body(args: argparse.Namespace, partial: bool = False) -> dict[str, Any]:
    """The tenant document the flags describe. `partial` (PATCH): only the flags given, and
    `--clear FIELD` as null; otherwise every limit given, the rest left to the server."""
    limits = {k: getattr(args, k) for k in LIMITS if getattr(args, k) is not None}
    body: dict[str, Any] = {}
    if args.name is not None:
        body["name"] = args.name
    if args.model:
        body["allowed_models"] = args.model
    if args.allow_overflow is not None:
        body["allow_overflow"] = args.allow_overflow
    if getattr(args, "priority_ceiling", None) is not None:
        body["priority_ceiling"] = args.priority_ceiling
    for field in getattr(args, "clear", []) or []:
        if field not in _CLEARABLE:
            raise ValueError(f"--clear {field}: not one of {', '.join(sorted(_CLEARABLE))}")
        if field in LIMITS:
            limits[field] = None
        else:
            body[field] = None
    if limits or not partial:
        body["limits"] = limits
    return body


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "all"
    return str(value)


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts))


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def render_table(kind: str, items: list[dict]) -> str:
    if kind == "tenants":
        return table(
            [
                "tenant",
                "name",
                "tpm",
                "tpd",
                "rpm",
                "concurrent",
                "context",
                "models",
                "overflow",
                "priority",
            ],
            [
                [
                    t["tenant_id"],
                    t["name"],
                    *(t["limits"].get(k) for k in LIMITS),
                    t["allowed_models"],
                    t["allow_overflow"],
                    t.get("priority_ceiling", 0),
                ]
                for t in items
            ],
        )
    if kind == "keys":
        return table(
            ["key id", "prefix", "name", "created", "expires", "last used", "revoked"],
            [
                [
                    k["key_id"],
                    k["prefix"],
                    k["name"],
                    _when(k["created_at"]),
                    _when(k["expires_at"]),
                    _when(k.get("last_used_at")),
                    k["revoked"],
                ]
                for k in items
            ],
        )
    return table(
        ["when", "who", "version"],
        [[_when(a["when"]), a["who"], a["new"].get("version")] for a in items],
    )


def render_usage(doc: dict, group_by: str) -> str:
    def group(row: dict) -> Any:
        value = row[group_by]
        if group_by == "day":
            return time.strftime("%Y-%m-%d", time.gmtime(value))
        if group_by == "hour":
            return time.strftime("%Y-%m-%d %H:00", time.gmtime(value))
        return value

    head = (
        f"usage {_when(doc['start'])} .. {_when(doc['end'])} UTC "
        f"({doc['granularity']} buckets), by {group_by}"
    )
    body = table(
        [
            "tenant",
            group_by,
            "requests",
            "errors",
            "prompt",
            "cached",
            "completion",
            "total",
            "mean ms",
        ],  # fmt: skip
        [
            [
                r["tenant_id"],
                group(r),
                r["requests"],
                r["errors"],
                r["prompt_tokens"],
                r["cached_tokens"],
                r["completion_tokens"],
                r["total_tokens"],
                r["mean_latency_ms"],
            ]
            for r in doc["data"]
        ],
    )
    return head + "\n" + body
