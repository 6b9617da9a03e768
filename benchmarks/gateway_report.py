"""The markdown report of `switchyard bench gateway`, and the figures derived from the
measured ones: added latency vs direct, the two-process scaling ratio, and notes on what
limited the throughput runs."""

import math
from typing import Any

from benchmarks.stats import markdown_table

WRK_CORE_BUSY = 0.8  # wrk (one thread) at this share of a core may itself be the limit
CPU_BOUND = 0.9  # a gateway process at this share of a core is CPU-bound
NEAR_DIRECT = 0.9  # a gateway at this share of the backend alone's req/s is held by the backend


def added_latency(paths: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per path and mode, p50/p99 minus direct's (ms); NaN where either is missing."""
    direct = paths.get("direct", {}).get("latency_ms", {})
    out = {}
    for name, p in paths.items():
        if name == "direct":
            continue
        lat = p.get("latency_ms", {})
        out[name] = {
            f"{mode}_{q}": _get(lat, mode, q) - _get(direct, mode, q)
            for mode in ("plain", "stream")
            for q in ("p50", "p99")
        }
    return out


def _get(d: dict, *keys: str) -> float:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return math.nan
        d = d[k]
    return d if isinstance(d, float | int) else math.nan


def rps_at(paths: dict[str, dict], name: str, mode: str, connections: int) -> float:
    for row in paths.get(name, {}).get("wrk", []):
        if row["mode"] == mode and row["connections"] == connections and "rps" in row:
            return row["rps"]
    return math.nan


def scaling_ratio(paths: dict[str, dict], connections: int = 64) -> dict[str, float]:
    """req/s of `switchyard x2` over `switchyard`, per mode, at `connections`."""
    return {
        mode: rps_at(paths, "switchyard x2", mode, connections)
        / rps_at(paths, "switchyard", mode, connections)
        for mode in ("plain", "stream")
    }


def cpu_at(paths: dict[str, dict], name: str, mode: str, connections: int) -> float:
    for row in paths.get(name, {}).get("wrk", []):
        if row["mode"] == mode and row["connections"] == connections:
            return row.get("cpu_ms_per_request", math.nan)
    return math.nan


def money_overhead(paths: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per mode and connection count, the gateway CPU per request of `switchyard $` (prices
    and a money budget) over `switchyard` (token quotas alone), minus 1: the share money
    adds (target <= 0.05)."""
    out: dict[str, dict[str, float]] = {}
    for row in paths.get("switchyard $", {}).get("wrk", []):
        mode, conns = row["mode"], row["connections"]
        base = cpu_at(paths, "switchyard", mode, conns)
        out.setdefault(mode, {})[str(conns)] = row.get("cpu_ms_per_request", math.nan) / base - 1
    return out


def bottleneck_notes(paths: dict[str, dict], cpu_count: int) -> list[str]:
    """What may have limited the wrk runs other than the gateway: wrk's own core, the
    backend (a gateway close to the backend alone's rate), or too few cores for wrk, the
    backend and the gateway's processes each to have one."""
    notes = []
    for name, p in paths.items():
        for row in p.get("wrk", []):
            if row.get("wrk_cores", 0) >= WRK_CORE_BUSY:
                notes.append(
                    f"{name} {row['mode']} c{row['connections']}: wrk used "
                    f"{row['wrk_cores']:.2f} of a core, so the load generator may be the limit."
                )
    for name, p in paths.items():
        processes = 2 if name == "switchyard x2" else 1
        for row in p.get("wrk", []):
            if name != "direct" and row.get("path_cores", 0) >= CPU_BOUND * processes:
                notes.append(
                    f"{name} {row['mode']} c{row['connections']}: its processes used "
                    f"{row['path_cores']:.2f} cores, so it was CPU-bound."
                )
    for name in paths:
        if name == "direct":
            continue
        for mode in ("plain", "stream"):
            gw, direct = rps_at(paths, name, mode, 64), rps_at(paths, "direct", mode, 64)
            if gw >= NEAR_DIRECT * direct:
                notes.append(
                    f"{name} {mode} c64: {gw:.0f} req/s is within {1 - NEAR_DIRECT:.0%} of the "
                    f"backend alone ({direct:.0f}), so the backend or wrk, not {name}, sets it."
                )
    needed = 2 + 2  # wrk, the backend, two gateway processes
    if cpu_count < needed:
        notes.append(
            f"This machine has {cpu_count} cores, fewer than the {needed} that wrk, the "
            "backend and two gateway processes need to have one each: they shared cores, so "
            "the x2 / x1 ratio is not the gateway's own scaling."
        )
    if not notes:
        notes.append(
            "wrk stayed under "
            f"{WRK_CORE_BUSY:.0%} of a core and every gateway well below the backend alone: "
            "the gateways set these rates."
        )
    return notes


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "/")[:160]


def paths_markdown(data: dict[str, Any]) -> list[str]:
    paths: dict[str, dict] = data["paths"]
    parts = ["## Paths\n"]
    parts.append(
        markdown_table(
            [
                {"path": n, "what": p["what"], "status": _cell(p.get("error", "ok"))}
                for n, p in paths.items()
            ],
            [("path", "path"), ("what", "what"), ("status", "status")],
        )
    )
    ok = {n: p for n, p in paths.items() if "error" not in p}
    added = data["added_latency_ms"]
    rows = []
    for n, p in ok.items():
        lat = p["latency_ms"]
        row = {"path": n, "note": _cell(lat.get("error", ""))}
        for mode in ("plain", "stream"):
            for q in ("p50", "p99"):
                row[f"{mode}_{q}"] = _get(lat, mode, q)
                row[f"added_{mode}_{q}"] = added.get(n, {}).get(f"{mode}_{q}", math.nan)
        rows.append(row)
    parts += [
        "\n## Latency, unloaded (sequential requests on one connection, Python client)\n",
        "8-token prompt; plain: 4 tokens in one JSON answer; stream: 4 SSE chunks. "
        "`added` is the path's figure minus direct's.\n",
        markdown_table(
            rows,
            [
                ("path", "path"),
                ("plain_p50", "plain p50 ms"),
                ("plain_p99", "plain p99 ms"),
                ("stream_p50", "stream p50 ms"),
                ("stream_p99", "stream p99 ms"),
                ("added_plain_p50", "added plain p50"),
                ("added_plain_p99", "added plain p99"),
                ("added_stream_p50", "added stream p50"),
                ("added_stream_p99", "added stream p99"),
                ("note", "note"),
            ],
        ),
        "\nTargets for `switchyard`: added p50 <= 2 ms, p99 <= 8 ms.",
    ]
    parts.append("\n## Throughput with wrk (closed loop, keep-alive connections)\n")
    if not data["wrk"]["available"]:
        parts.append(f"**Skipped: {data['wrk']['note']}**")
    else:
        parts.append(
            f"{data['wrk']['duration_s']:.0f} s per cell, one wrk thread; plain: 4 tokens, "
            "stream: 16 SSE chunks read to the end. CPU ms/request: user + system CPU of "
            "the path's process tree (the backend's for direct, every gateway process for "
            "`switchyard x2`) over the requests wrk completed; path cores: the same CPU over "
            "the run's length; Redis: the embedded quota store's CPU per request; wrk cores: "
            "wrk's own CPU over the run's length.\n"
        )
        rows = [
            {"path": n, **r, "error": _cell(r.get("error", ""))}
            for n, p in ok.items()
            for r in p["wrk"]
        ]
        parts.append(
            markdown_table(
                rows,
                [
                    ("path", "path"),
                    ("mode", "mode"),
                    ("connections", "conns"),
                    ("rps", "req/s"),
                    ("p50_ms", "p50 ms"),
                    ("p99_ms", "p99 ms"),
                    ("errors", "errors"),
                    ("cpu_ms_per_request", "CPU ms/req"),
                    ("path_cores", "path cores"),
                    ("extra_cpu_ms_per_request", "Redis CPU ms/req"),
                    ("wrk_cores", "wrk cores"),
                    ("error", "error"),
                ],
            )
        )
        ratio = data["scaling_x2_over_x1_c64"]
        parts.append(
            f"\n`switchyard x2` / `switchyard` at c64: plain {ratio['plain']:.2f}x, "
            f"stream {ratio['stream']:.2f}x."
        )
        money = data.get("money_cpu_over_tokens") or {}
        cells = [
            f"{mode} c{conns} {100 * share:+.1f}%"
            for mode, by in money.items()
            for conns, share in by.items()
        ]
        if cells:
            parts.append(
                "\nGateway CPU per request with prices and a money budget (`switchyard $`) "
                "over token quotas alone (`switchyard`), target +5% at most: "
                + ", ".join(cells)
                + "."
            )
        parts.append("\nWhat limited these runs:\n")
        parts += [f"- {note}" for note in data["bottleneck_notes"]]
    rows = []
    for n, p in ok.items():
        rd = p["relay_delay_ms"]
        note = rd.get("error") or (
            "no backend timestamps came through" if not rd.get("chunks") else ""
        )
        rows.append(
            {
                "path": n,
                "p50": _get(rd, "p50"),
                "p99": _get(rd, "p99"),
                "added_p99": _get(rd, "p99") - _get(ok.get("direct", {}), "relay_delay_ms", "p99"),
                "chunks": rd.get("chunks", 0),
                "note": _cell(note),
            }
        )
    parts += [
        "\n## Relay delay per chunk (client arrival - backend send time, 32-token streams)\n",
        markdown_table(
            rows,
            [
                ("path", "path"),
                ("p50", "p50 ms"),
                ("p99", "p99 ms"),
                ("added_p99", "added p99 ms"),
                ("chunks", "chunks"),
                ("note", "note"),
            ],
        ),
        "\nTarget for `switchyard`: added p99 <= 1 ms.",
    ]
    return parts


def overload_fairness_markdown(d: dict[str, Any]) -> list[str]:
    wait_ms = d["overload"]["bounded"].get("max_wait_s", 0.02) * 1e3
    parts = [
        "\n## Overload: 3x capacity (120 req/s offered, ~40 req/s capacity), deadline 2 s\n",
        f"bounded: a queue of 2 requests and at most {wait_ms:g} ms of waiting "
        "(`queue_max_wait_s`); unbounded: neither bound, a deadline of an hour.\n",
    ]
    rows = []
    for name, v in d["overload"].items():
        for phase in ("unloaded", "overloaded"):
            rows.append({"queue": name, "phase": phase, **v[phase]})
    cols = [
        ("queue", "queue"),
        ("phase", "phase"),
        ("accepted", "accepted"),
        ("refused", "refused"),
        ("refusals_without_retry_after", "refusals w/o Retry-After"),
        ("served_past_deadline", "past deadline"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p99_ms", "TTFT p99 ms"),
    ]
    parts.append(markdown_table(rows, cols))
    b = d["overload"]["bounded"]
    ratio = b["overloaded"]["ttft_p99_ms"] / b["unloaded"]["ttft_p99_ms"]
    parts.append(f"\nBounded queue: accepted p99 TTFT {ratio:.2f}x unloaded p99 (target <= 2x).")
    f = d["fairness"]
    fr = f["light_with_heavy"]["ttft_p99_ms"] / f["light_solo"]["ttft_p99_ms"]
    parts += [
        "\n## Fairness: one tenant at 10x the other's rate, the workers saturated\n",
        "Capacity 32 streams in flight x 5/s = 160 req/s; offered 16 (light) + 160 (heavy). "
        "`client cores`: the load generator's own CPU (near 1: it measured itself).\n",
        markdown_table(
            [{"who": k, **v} for k, v in f.items()],
            [
                ("who", "tenant"),
                ("accepted", "accepted"),
                ("refused", "refused"),
                ("ttft_p50_ms", "TTFT p50 ms"),
                ("ttft_p99_ms", "TTFT p99 ms"),
                ("client_cores", "client cores"),
            ],
        ),
        f"\nLight tenant p99 TTFT with the heavy one {fr:.2f}x its solo value (target <= 1.5x).",
    ]
    parts += _cpu_saturated_markdown(d.get("fairness_cpu_saturated"))
    return parts


def _cpu_saturated_markdown(f: dict[str, Any] | None) -> list[str]:
    if not f:
        return []
    head = "\n## Fairness with the gateway's own CPU saturated\n"
    if "skipped" in f:
        return [head, f"Skipped: {f['skipped']}."]
    fr = f["light_with_heavy"]["ttft_p99_ms"] / f["light_solo"]["ttft_p99_ms"]
    h = f["heavy"]
    return [
        head,
        "A heavy tenant from wrk (64 connections, plain requests back to back, more than one "
        "gateway process relays) and a light tenant at 16 streams/s, on the same machine as "
        "the gateway, the fake backend and Redis. The door (gateway/capacity/door.py) holds the "
        "tenant over its share to fewer requests in flight while the light tenant's latency "
        "to its reservation is over the gateway's floor; the rest wait in their lane.\n",
        markdown_table(
            [{"who": k, **v} for k, v in f.items() if k != "heavy"],
            [
                ("who", "tenant"),
                ("accepted", "accepted"),
                ("refused", "refused"),
                ("ttft_p50_ms", "TTFT p50 ms"),
                ("ttft_p99_ms", "TTFT p99 ms"),
            ],
        ),
        f"\nHeavy tenant: {h['requests']:,} requests, {h['refused_or_failed']:,} refused (429 "
        f"at the door) or failed, {h['served_per_s']:.0f} served/s while the light tenant "
        "ran (the price of its latency on this machine).",
        f"\nLight tenant p99 TTFT with the heavy one {fr:.2f}x its solo value (target <= 1.5x).",
    ]


def gateway_markdown(data: dict[str, Any], quick: bool) -> str:
    parts = ["**Quick smoke run: these figures are not the benchmark.**\n"] if quick else []
    parts += paths_markdown(data)
    parts += overload_fairness_markdown(data)
    parts += money_ab_markdown(data.get("money_ab"))
    return "\n".join(parts)


def money_ab_markdown(ab: dict[str, Any] | None) -> list[str]:
    if not ab:
        return []
    parts = ["\n## Money: the gateway CPU that prices and budgets add\n"]
    if "error" in ab:
        return parts + [f"Not measured: {ab['error']}"]
    parts.append(
        f"A gateway with token quotas alone and one with the pool priced and the tenant under "
        f"a money budget, each started fresh and loaded in turn with plain requests (wrk, "
        f"{ab['connections']} connections, {ab['run_s']:.0f} s), {len(ab['rounds'])} rounds.\n"
    )
    rows = [
        {"round": i + 1, **r, "added": f"{100 * (r['money'] / r['tokens'] - 1):+.1f}%"}
        for i, r in enumerate(ab["rounds"])
    ]
    parts.append(
        markdown_table(
            rows,
            [
                ("round", "round"),
                ("tokens", "tokens only: CPU ms/req"),
                ("money", "with money: CPU ms/req"),
                ("added", "added"),
            ],
        )
    )
    verdict = "met" if ab["median_added"] <= ab["target_added"] else "not met"
    parts.append(
        f"\nMedian added: {100 * ab['median_added']:+.1f}% (target "
        f"<= +{100 * ab['target_added']:.0f}%): {verdict}."
    )
    return parts
