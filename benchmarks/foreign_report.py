"""Summaries, verdicts and the markdown of `switchyard bench foreign`: pure functions over
the figures the load collected (seconds in, milliseconds out)."""

import math
from collections.abc import Sequence
from typing import Any

from benchmarks.foreign_load import StreamResult
from benchmarks.loadgen import Outcome
from benchmarks.stats import markdown_table, percentile

# The targets the bench checks (docs/benchmarks/foreign-pools.md).
ADDED_P50_TARGET_MS = 2.0
LATE_ACCEPTED_TARGET = 0


def latency_ms(xs_s: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(xs_s, 50) * 1e3,
        "p99": percentile(xs_s, 99) * 1e3,
        "n": len(xs_s),
    }


def summarise_sequential(run: dict, idle_gateway_cores: float) -> dict[str, Any]:
    """One mode's alternating run: each target's p50/p99, what the gateway adds, and its
    CPU milliseconds per request, gross and net of what it spends idle (its polling)."""
    direct, gateway = latency_ms(run["direct"]), latency_ms(run["gateway"])
    n = len(run["gateway"])
    gross = run["gateway_cpu_s"] * 1e3 / n if n else math.nan
    idle_ms = idle_gateway_cores * run["gateway_wall_s"] * 1e3 / n if n else math.nan
    return {
        "direct_ms": direct,
        "gateway_ms": gateway,
        "added_p50_ms": gateway["p50"] - direct["p50"],
        "added_p99_ms": gateway["p99"] - direct["p99"],
        "gateway_cpu_ms_per_request": gross,
        "gateway_cpu_ms_per_request_net": max(gross - idle_ms, 0.0),
        "failed": dict(run.get("errors") or {}),
        "first_error": dict(run.get("first_error") or {}),
    }


def summarise_burst(
    results: Sequence[StreamResult], wall_s: float, ttft_target_s: float
) -> dict[str, Any]:
    """A burst's outcome: served (a first token came), refused before any token (a non-200
    status, or an error as the first event), failed (no answer), accepted past the TTFT
    target, and the served streams' TTFT and tokens/s."""
    served = [r for r in results if r.ttft_s is not None]
    refused = [r for r in results if r.status not in (None, 200) or r.error_in_band]
    ttfts = [r.ttft_s for r in served if r.ttft_s is not None]
    return {
        "sent": len(results),
        "served": len(served),
        "refused": len(refused),
        "refused_with_retry_after": sum(r.retry_after for r in refused),
        "refused_statuses": sorted({r.status for r in refused if r.status not in (None, 200)}),
        "refused_in_band": sum(r.error_in_band for r in refused),
        "failed": len(results) - len(served) - len(refused),
        "late": sum(t > ttft_target_s for t in ttfts),
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "tokens": sum(r.num_chunks for r in served),
        "tokens_per_s": sum(r.num_chunks for r in served) / wall_s if wall_s > 0 else math.nan,
        "wall_s": wall_s,
    }


def summarise_way(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, Any]:
    """One way of the cascade's mixed load: served (a first token came, the stream ended
    without error), refused (429/503, or an error before any token), failed (the rest);
    the share of the served that the small pool answered (x-switchyard-model) overall and
    per kind, those that overflowed, output tokens (usage) per second over the way's wall
    time (its start to the last request's end) and the served TTFT."""
    served = [o for o in outcomes if o.ok and o.ttft_s is not None]
    refused = [
        o for o in outcomes if o.status in (429, 503) or (o.status == 200 and o.ttft_s is None)
    ]
    ttfts = [o.ttft_s for o in served if o.ttft_s is not None]
    tokens = sum(o.completion_tokens for o in served)

    def small_share(kind: str | None) -> float:
        of = [o for o in served if kind is None or o.kind == kind]
        return sum(o.pool == "small" for o in of) / len(of) if of else math.nan

    return {
        "sent": len(outcomes),
        "served": len(served),
        "refused": len(refused),
        "failed": len(outcomes) - len(served) - len(refused),
        "small_share": small_share(None),
        "small_share_easy": small_share("easy"),
        "small_share_hard": small_share("hard"),
        "overflowed": sum(o.route == "overflow" for o in served),
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else math.nan,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "wall_s": wall_s,
        "first_error": next((o.error for o in outcomes if o.error), None),
    }


def summarise_large_load(
    samples: Sequence[dict[str, float]],
    before: dict[str, float],
    after: dict[str, float],
    wall_s: float,
    num_slots: int,
) -> dict[str, Any]:
    """The large pool's load over a way, from llama-server's /metrics: mean slots busy
    (sampled), most requests waiting for a slot, the tokens it generated and the prompt
    tokens it evaluated (its counters, after less before; prompt-cache hits are not
    evaluated), and its output tokens per second of the way."""
    busy = [s["requests_processing"] for s in samples]
    out_tokens = after["tokens_predicted_total"] - before["tokens_predicted_total"]
    return {
        "busy_slots_mean": sum(busy) / len(busy) if busy else math.nan,
        "slots": num_slots,
        "waiting_max": max((s["requests_deferred"] for s in samples), default=math.nan),
        "output_tokens": out_tokens,
        "prompt_tokens": after["prompt_tokens_total"] - before["prompt_tokens_total"],
        "tokens_per_s": out_tokens / wall_s if wall_s > 0 else math.nan,
        "num_samples": len(samples),
    }


def verdicts(data: dict[str, Any]) -> dict[str, bool | None]:
    """Whether each target was met; None where its figure is missing (a failed part)."""
    seq = data.get("sequential") or {}
    added = [m["added_p50_ms"] for m in seq.values() if isinstance(m, dict) and "added_p50_ms" in m]
    gw = (data.get("burst") or {}).get("gateway") or {}
    return {
        "added_p50_le_2ms": (
            all(a <= ADDED_P50_TARGET_MS for a in added)
            if added and len(added) == len(seq)
            else None
        ),
        "burst_no_accepted_late": (
            gw["late"] <= LATE_ACCEPTED_TARGET and gw["served"] > 0 if "late" in gw else None
        ),
    }


SEQ_COLUMNS = [
    ("mode", "mode"),
    ("direct_p50", "direct p50 ms"),
    ("direct_p99", "direct p99 ms"),
    ("gateway_p50", "gateway p50 ms"),
    ("gateway_p99", "gateway p99 ms"),
    ("added_p50_ms", "added p50 ms"),
    ("added_p99_ms", "added p99 ms"),
    ("gateway_cpu_ms_per_request", "gw CPU ms/req"),
    ("gateway_cpu_ms_per_request_net", "gw CPU ms/req net of idle"),
    ("failed", "failed direct/gw"),
]
BURST_COLUMNS = [
    ("path", "path"),
    ("sent", "sent"),
    ("served", "served"),
    ("refused", "refused"),
    ("refused_with_retry_after", "with Retry-After"),
    ("failed", "failed"),
    ("late", "served past TTFT target"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("tokens_per_s", "tok/s"),
]


CASCADE_COLUMNS = [
    ("way", "way (model)"),
    ("sent", "sent"),
    ("served", "served"),
    ("refused", "refused"),
    ("failed", "failed"),
    ("small_pct", "routed small %"),
    ("small_pct_by_kind", "small % easy/hard"),
    ("overflowed", "overflowed"),
    ("tokens_per_s", "output tok/s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("large_busy", "large busy slots"),
    ("large_waiting_max", "large waiting max"),
    ("large_tokens_per_s", "large output tok/s"),
]


def _pct(share: float) -> str:
    return "n/a" if math.isnan(share) else f"{share * 100:.0f}"


def cascade_rows(cascade: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for way, w in cascade.items():
        if not isinstance(w, dict):
            continue
        name = f"{way} ({w.get('model', way)})"
        if "error" in w:
            rows.append({"way": name, "sent": w["error"]})
            continue
        large = w["large"]
        rows.append(
            {
                **w,
                "way": name,
                "small_pct": _pct(w["small_share"]),
                "small_pct_by_kind": f"{_pct(w['small_share_easy'])}/{_pct(w['small_share_hard'])}",
                "large_busy": f"{large['busy_slots_mean']:.2f} of {large['slots']}",
                "large_waiting_max": large["waiting_max"],
                "large_tokens_per_s": large["tokens_per_s"],
            }
        )
    return rows


def sequential_rows(seq: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for mode, m in seq.items():
        if "error" in m:
            rows.append({"mode": mode, "direct_p50": m["error"]})
            continue
        rows.append(
            {
                "mode": mode,
                "direct_p50": m["direct_ms"]["p50"],
                "direct_p99": m["direct_ms"]["p99"],
                "gateway_p50": m["gateway_ms"]["p50"],
                "gateway_p99": m["gateway_ms"]["p99"],
                **{k: m[k] for k, _ in SEQ_COLUMNS[5:-1]},
                "failed": f"{m['failed'].get('direct', 0)}/{m['failed'].get('gateway', 0)}",
            }
        )
    return rows


def burst_rows(burst: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"path": name, "sent": b["error"]} if "error" in b else {"path": name, **b}
        for name, b in burst.items()
        if isinstance(b, dict)
    ]


def _verdict_line(name: str, ok: bool | None) -> str:
    return f"- {name}: " + ("n/a (not measured)" if ok is None else "met" if ok else "NOT met")


def _cascade_section(cascade: dict[str, Any] | None, opts: dict[str, Any]) -> list[str]:
    if not cascade:
        return []
    return [
        f"## Cascade: a mixed load over small (a Switchyard worker) and large (llama-server), "
        f"{cascade.get('arrivals', 0)} requests ({cascade.get('hard', 0)} hard) at "
        f"{opts['cascade_rate_per_s']} /s for {opts['cascade_duration_s']} s per way",
        "",
        *([f"Not run: {cascade['error']}"] if "error" in cascade else []),
        markdown_table(cascade_rows(cascade), CASCADE_COLUMNS),
        "",
    ]


def _sequential_section(data: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    if "sequential" not in data:
        return []
    return [
        f"## Sequential, concurrency 1 ({opts['num_pairs']} requests per path and mode, "
        f"{opts['max_tokens']} tokens, greedy, alternating)",
        "",
        markdown_table(sequential_rows(data["sequential"] or {}), SEQ_COLUMNS),
        "",
        f"Gateway idle (polling every {opts.get('poll_interval_s', math.nan)} s) CPU: "
        f"{data.get('idle_gateway_cores', math.nan) * 1e3:.1f} ms per second.",
        "",
        *_reference_section(data.get("reference")),
    ]


def _reference_section(ref: dict[str, Any] | None) -> list[str]:
    """The same requests through a gateway of our own kind in front of the fake backend,
    answering in about as long: what any gateway adds at that upstream latency."""
    if not ref:
        return []
    if "error" in ref:
        return [f"Reference (fake backend, kind switchyard) not run: {ref['error']}", ""]
    return [
        "The same through a gateway of our own kind (`switchyard`) in front of the fake "
        f"backend, answering in about as long ({ref['token_delay_s'] * 1e3:.1f} ms a token):",
        "",
        markdown_table(sequential_rows(ref["sequential"] or {}), SEQ_COLUMNS),
        "",
    ]


def _burst_section(data: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    if "burst" not in data:
        return []
    return [
        f"## Burst: {opts['burst_streams']} concurrent streams of {opts['burst_tokens']} "
        f"tokens, TTFT target {opts['ttft_target_s']:.1f} s",
        "",
        markdown_table(burst_rows(data["burst"] or {}), BURST_COLUMNS),
        "",
    ]


def foreign_markdown(data: dict[str, Any]) -> str:
    """The report; a part the run skipped has no section."""
    opts = data["options"]
    v = data["verdicts"]
    lines = [
        "# Switchyard gateway in front of llama-server",
        "",
        f"llama-server: {opts['slots']} slots, {opts['threads']} thread(s), "
        f"{opts['ctx_per_slot']} ctx/slot; {opts['cpu_count']} cores on this machine.",
        "",
        *_sequential_section(data, opts),
        *_burst_section(data, opts),
        *_cascade_section(data.get("cascade"), opts),
        "## Targets",
        "",
        _verdict_line(f"added p50 <= {ADDED_P50_TARGET_MS:.0f} ms", v["added_p50_le_2ms"]),
        _verdict_line(
            "0 accepted burst requests past the TTFT target", v["burst_no_accepted_late"]
        ),
    ]
    return "\n".join(lines)
