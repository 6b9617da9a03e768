"""`switchyard load`: flood the running stack and watch it (rich live view), then write a
JSON report. Tenants `load-1..N` are created through the admin API when missing (the
admin key of the local `switchyard serve` is found without a variable)."""

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v * 1000:.0f} ms" if unit == "ms" else f"{v:.2f}"
    return str(v)


def _admin(url: str, key: str | None) -> httpx.Client | None:
    if not key:
        return None
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=5)


def _tenant_keys(admin: httpx.Client | None, n: int) -> list[str]:
    """One fresh key per tenant load-1..n (tenants created when missing)."""
    if admin is None:
        raise SystemExit(
            "error: --tenants needs the admin key (run against a local `switchyard serve`, "
            "or set SWITCHYARD_ADMIN_KEY); or pass --api-key for one tenant"
        )
    keys = []
    for i in range(1, n + 1):
        tenant = f"load-{i}"
        r = admin.post("/admin/tenants", json={"tenant_id": tenant, "name": tenant})
        if r.status_code not in (201, 409):
            raise SystemExit(f"error: creating tenant {tenant}: {r.status_code} {r.text[:200]}")
        r = admin.post(f"/admin/tenants/{tenant}/keys", json={"name": "switchyard load"})
        if r.status_code != 201:
            raise SystemExit(f"error: creating a key of {tenant}: {r.status_code} {r.text[:200]}")
        keys.append(r.json()["key"])
    return keys


def _fleet(admin: httpx.Client | None) -> dict[str, Any]:
    if admin is None:
        return {}
    try:
        doc = admin.get("/admin/fleet", timeout=1).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {
        pool: {
            "replicas": len(p.get("replicas") or p.get("workers") or []),
            "ready": sum(
                r["state"] == "ready" for r in (p.get("replicas") or p.get("workers") or [])
            ),
            "queue": p.get("waiting"),
        }
        for pool, p in doc.items()
    }


def _view(stats_now: dict, fleet: dict, t: float, duration_s: float):  # noqa: ANN202
    from rich.table import Table

    table = Table(title=f"switchyard load · {t:.0f}/{duration_s:.0f} s · last 5 s")
    for col in ("offered/s", "served/s", "in flight", "TTFT p50", "TTFT p99", "ITL p50"):
        table.add_column(col, justify="right")
    table.add_column("ITL p99", justify="right")
    table.add_column("refused (Retry-After max)", justify="right")
    table.add_column("failed", justify="right")
    table.add_row(
        _fmt(stats_now["offered_per_s"]),
        _fmt(stats_now["served_per_s"]),
        str(stats_now["inflight"]),
        _fmt(stats_now["ttft_p50_s"], "ms"),
        _fmt(stats_now["ttft_p99_s"], "ms"),
        _fmt(stats_now["itl_p50_s"], "ms"),
        _fmt(stats_now["itl_p99_s"], "ms"),
        f"{stats_now['refused']} ({_fmt(stats_now['retry_after_s_max'])} s)",
        str(stats_now["failed"]),
    )
    pools = Table(title="pools")
    for col in ("pool", "replicas (ready)", "gateway queue"):
        pools.add_column(col)
    for name, p in fleet.items():
        pools.add_row(name, f"{p['replicas']} ({p['ready']})", _fmt(p["queue"]))
    from rich.console import Group

    return Group(table, pools)


def run(args: argparse.Namespace) -> int:
    from benchmarks.loadgen import MIXES, LoadOptions, LoadStats, report_dict, run_load
    from cli.commands.models import cache_dir
    from cli.serve.state import local_admin_key, local_stack

    stack = local_stack(cache_dir(None))
    root = args.url or (stack["url"] if stack else None)
    if root is None:
        base = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
        root = base.removesuffix("/").removesuffix("/v1")
    root = root.rstrip("/")
    mix = tuple(m.strip() for m in args.mix.split(",") if m.strip())
    unknown = set(mix) - set(MIXES)
    if unknown or not mix:
        print(f"error: --mix takes some of {','.join(MIXES)}", file=sys.stderr)
        return 2
    admin_key = os.environ.get("SWITCHYARD_ADMIN_KEY") or local_admin_key(cache_dir(None), root)
    admin = _admin(root, admin_key)
    try:
        keys = [args.api_key] if args.api_key else _tenant_keys(admin, args.tenants)
    except httpx.TransportError as exc:
        print(f"error: cannot reach the gateway at {root} ({type(exc).__name__})", file=sys.stderr)
        return 1
    opts = LoadOptions(
        base_url=f"{root}/v1",
        keys=keys,
        rate_per_s=args.rate,
        duration_s=args.duration,
        mix=mix,
        model=args.model,
        seed=args.seed,
    )
    stats = LoadStats()
    samples: list = []
    state: dict[str, Any] = {"fleet": {}, "polled": 0.0}

    def tick(t: float) -> Any:
        if admin is not None and time.monotonic() - state["polled"] >= 1.0:
            state["polled"] = time.monotonic()
            state["fleet"] = _fleet(admin)
            samples.append([round(t, 1), state["fleet"]])
        return stats.window(t, 5.0)

    live = None
    if sys.stdout.isatty():
        from rich.live import Live

        live = Live(refresh_per_second=4)

        def on_tick(t: float) -> None:
            live.update(_view(tick(t), state["fleet"], t, args.duration))

    else:

        def on_tick(t: float) -> None:
            now = tick(t)
            if int(t * 2) % 10 == 0:  # every 5 s
                print(
                    f"t={t:.0f}s offered/s={now['offered_per_s']} served/s={now['served_per_s']} "
                    f"inflight={now['inflight']} ttft_p50={_fmt(now['ttft_p50_s'], 'ms')} "
                    f"refused={now['refused']} failed={now['failed']} fleet={state['fleet']}",
                    flush=True,
                )

    try:
        if live is not None:
            with live:
                elapsed = asyncio.run(run_load(opts, stats, on_tick))
        else:
            elapsed = asyncio.run(run_load(opts, stats, on_tick))
    finally:
        if admin is not None:
            admin.close()
    report = report_dict(opts, stats, elapsed, samples)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    s = report["summary"]
    print(
        f"offered {s['offered']} ({s['offered_per_s']}/s), served {s['served']}, "
        f"refused {s['refused']}, failed {s['failed']}; TTFT p50 {_fmt(s['ttft_p50_s'], 'ms')} "
        f"p99 {_fmt(s['ttft_p99_s'], 'ms')}; ITL p50 {_fmt(s['itl_p50_s'], 'ms')} "
        f"p99 {_fmt(s['itl_p99_s'], 'ms')}; routes {s['routes']}"
    )
    print(f"report: {out}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    load = subparsers.add_parser(
        "load",
        help="open-loop load against the running stack, with a live view and a JSON report",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    load.add_argument("--rate", type=float, default=5.0, help="requests per second (Poisson)")
    load.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    load.add_argument("--tenants", type=int, default=2, help="tenants load-1..N, made if missing")
    load.add_argument(
        "--mix", default="short,long,shared-prefix", help="workload kinds, picked uniformly"
    )
    load.add_argument("--model", default="auto", help="pool name or auto")
    load.add_argument(
        "--url", default=None, help="the gateway (default: the local `switchyard serve`)"
    )
    load.add_argument(
        "--api-key", default=None, help="use this key (one tenant) instead of making tenants"
    )
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--out", default="bench-results/load-report.json", help="the JSON report")
    load.set_defaults(run=run)
