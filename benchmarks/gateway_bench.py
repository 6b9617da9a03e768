"""`switchyard bench gateway`: the gateway in front of a fast fake backend vs the backend
alone, in one run: added latency, throughput, relay delay, overload and fairness."""

import asyncio
import json
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml
from tqdm import tqdm

from benchmarks.processes import child_process, free_port, wait_http
from benchmarks.stats import markdown_table, percentile, write_report

ADMIN = "bench-admin"
BODY = {"model": "small", "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 4}


@dataclass
class GatewayBenchOptions:
    out_dir: Path
    quick: bool = False
    overload_s: float = 60.0


@contextmanager
def bench_stack(tmp: Path, redis_url: str, token_delay_s: float = 0.0, **gateway_cfg):
    """A fake backend and a gateway process in front of it; yields (gateway, backend) URLs."""
    bport, gport = free_port(), free_port()
    backend = f"http://127.0.0.1:{bport}"
    cfg = {
        "pools": {"small": [backend]},
        "redis_url": redis_url,
        "admin_key": ADMIN,
        "load_poll_interval_s": 0.1,
        **gateway_cfg,
    }
    cfg_path = tmp / f"gateway-{gport}.yaml"
    cfg_path.write_text(yaml.safe_dump({"gateway": cfg}))
    with ExitStack() as stack:
        stack.enter_context(
            child_process(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.fake_backend",
                    "--port",
                    str(bport),
                    "--token-delay-s",
                    str(token_delay_s),
                ],
                tmp / "backend.log",
            )
        )
        wait_http(backend)
        stack.enter_context(
            child_process(
                [
                    sys.executable,
                    "-m",
                    "cli.main",
                    "gateway",
                    "--config",
                    str(cfg_path),
                    "--port",
                    str(gport),
                ],
                tmp / f"gateway-{gport}.log",
            )
        )
        gateway = f"http://127.0.0.1:{gport}"
        wait_http(gateway, "/ready")
        yield gateway, backend


def _make_key(gateway: str, tenant: str, **limits) -> str:
    h = {"authorization": f"Bearer {ADMIN}"}
    httpx.post(f"{gateway}/admin/tenants", json={"tenant_id": tenant, "limits": limits}, headers=h)
    return httpx.post(f"{gateway}/admin/tenants/{tenant}/keys", json={}, headers=h).json()["key"]


async def _latencies(url: str, key: str, n: int, stream: bool) -> list[float]:
    out = []
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            if stream:
                async with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
                    async for _ in r.aiter_bytes():
                        pass
            else:
                (await c.post("/v1/completions", json=BODY)).raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


async def _throughput(url: str, key: str, duration_s: float, concurrency: int) -> float:
    headers = {"authorization": f"Bearer {key}"}
    done = 0
    stop = time.perf_counter() + duration_s
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30, limits=limits) as c:

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                r = await c.post("/v1/completions", json=BODY)
                done += r.status_code == 200

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


async def _relay_delays(url: str, key: str, n: int) -> list[float]:
    """Per chunk: arrival at the client minus the backend's send time."""
    headers = {"authorization": f"Bearer {key}"}
    out = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as c:
        for _ in range(n):
            async with c.stream(
                "POST", "/v1/completions", json={**BODY, "max_tokens": 32, "stream": True}
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"sent_at"' in line:
                        out.append(time.time() - json.loads(line[6:])["sent_at"])
    return out


SLOW_BODY = {**BODY, "max_tokens": 20, "stream": True}  # 20 tokens x 10 ms: 0.2 s of service


async def _open_loop(
    url: str, keys: dict[str, float], duration_s: float, deadline_s: float
) -> dict:
    """Offered load per tenant key (requests/s, Poisson-free fixed spacing): TTFT of
    accepted streams, refusals and whether each carried Retry-After, deadline misses."""
    results: dict[str, dict] = {
        k: {"ttft": [], "refused": 0, "no_retry_after": 0, "late": 0} for k in keys
    }
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=500)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:

        async def one(key: str) -> None:
            res = results[key]
            t0 = time.perf_counter()
            hdrs = {"authorization": f"Bearer {key}", "x-request-timeout": str(deadline_s)}
            async with c.stream("POST", "/v1/completions", json=SLOW_BODY, headers=hdrs) as r:
                if r.status_code != 200:
                    res["refused"] += 1
                    res["no_retry_after"] += "retry-after" not in r.headers
                    return
                first = True
                async for line in r.aiter_lines():
                    # Read the whole stream: the request holds its worker slot until done.
                    if first and line.startswith("data: {"):
                        first = False
                        if '"error"' in line:
                            res["refused"] += 1
                            return
                        ttft = time.perf_counter() - t0
                        res["ttft"].append(ttft)
                        res["late"] += ttft > deadline_s

        tasks = []
        start = time.perf_counter()
        next_at = {k: start for k in keys}
        while time.perf_counter() - start < duration_s:
            now = time.perf_counter()
            for key, rate in keys.items():
                while next_at[key] <= now:
                    tasks.append(asyncio.ensure_future(one(key)))
                    next_at[key] += 1.0 / rate
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks, return_exceptions=True)
    return results


def _summ(res: dict) -> dict:
    t = res["ttft"]
    return {
        "accepted": len(t),
        "refused": res["refused"],
        "refusals_without_retry_after": res["no_retry_after"],
        "served_past_deadline": res["late"],
        "ttft_p50_ms": percentile(t, 50) * 1e3,
        "ttft_p99_ms": percentile(t, 99) * 1e3,
    }


def run_gateway_bench(opts: GatewayBenchOptions) -> dict:
    from gateway.embedded_redis import EmbeddedRedis

    n = 100 if opts.quick else 500
    overload_s = 5.0 if opts.quick else opts.overload_s
    data: dict = {"options": {"quick": opts.quick, "overload_s": overload_s}}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        redis = EmbeddedRedis(tmp / "redis")
        steps = tqdm(total=5, desc="bench gateway", unit="scenario")
        try:
            with bench_stack(tmp, redis.url) as (gw, backend):
                key = _make_key(gw, "bench")
                lat = {}
                for name, url in (("direct", backend), ("gateway", gw)):
                    for stream in (False, True):
                        xs = asyncio.run(_latencies(url, key, n, stream))
                        lat[f"{name}_{'stream' if stream else 'json'}"] = xs
                data["latency_ms"] = {
                    k: {"p50": percentile(v, 50) * 1e3, "p99": percentile(v, 99) * 1e3}
                    for k, v in lat.items()
                }
                steps.update()
                data["throughput_rps"] = {
                    "direct": asyncio.run(_throughput(backend, key, 5.0, 32)),
                    "gateway": asyncio.run(_throughput(gw, key, 5.0, 32)),
                }
                steps.update()
                d_direct = asyncio.run(_relay_delays(backend, key, 20))
                d_gw = asyncio.run(_relay_delays(gw, key, 20))
                data["relay_delay_ms"] = {
                    "direct_p50": percentile(d_direct, 50) * 1e3,
                    "direct_p99": percentile(d_direct, 99) * 1e3,
                    "gateway_p50": percentile(d_gw, 50) * 1e3,
                    "gateway_p99": percentile(d_gw, 99) * 1e3,
                }
                steps.update()
            # Overload: a backend with capacity ~ 8 in flight x (1 / 0.2 s) = 40 requests/s.
            overload = {}
            for name, cfg in (
                ("bounded", {"queue_max_requests": 2}),
                (
                    "unbounded",
                    {
                        "queue_max_requests": 1_000_000,
                        "queue_max_tokens": 10**12,
                        "request_timeout_s": 3600,
                    },
                ),
            ):
                with bench_stack(
                    tmp, redis.url, token_delay_s=0.01, max_inflight_per_worker=8, **cfg
                ) as (gw, _):
                    key = _make_key(gw, f"over-{name}")
                    solo = asyncio.run(_open_loop(gw, {key: 10.0}, min(overload_s, 10.0), 2.0))[key]
                    loaded = asyncio.run(
                        _open_loop(gw, {key: 120.0}, overload_s, 2.0 if name == "bounded" else 3600)
                    )[key]
                    overload[name] = {"unloaded": _summ(solo), "overloaded": _summ(loaded)}
            data["overload"] = overload
            steps.update()
            with bench_stack(
                tmp,
                redis.url,
                token_delay_s=0.01,
                max_inflight_per_worker=32,
                queue_max_requests=256,
            ) as (gw, _):
                heavy, light = _make_key(gw, "heavy"), _make_key(gw, "light")
                solo = asyncio.run(_open_loop(gw, {light: 16.0}, min(overload_s, 15.0), 30.0))[
                    light
                ]
                both = asyncio.run(
                    _open_loop(gw, {light: 16.0, heavy: 160.0}, min(overload_s, 15.0), 30.0)
                )
                data["fairness"] = {
                    "light_solo": _summ(solo),
                    "light_with_heavy": _summ(both[light]),
                    "heavy": _summ(both[heavy]),
                }
            steps.update()
            steps.close()
        finally:
            redis.close()
    md = _markdown(data, opts)
    json_path, md_path = write_report(opts.out_dir, "gateway", data, md)
    print(md)
    print(f"\nwrote {json_path} and {md_path}")
    return data


def _markdown(d: dict, opts: GatewayBenchOptions) -> str:
    lat = d["latency_ms"]
    rows = [{"path": k, **v} for k, v in lat.items()]
    added = {
        m: {q: lat[f"gateway_{m}"][q] - lat[f"direct_{m}"][q] for q in ("p50", "p99")}
        for m in ("json", "stream")
    }
    d["added_latency_ms"] = added
    relay = d["relay_delay_ms"]
    parts = ["**Quick smoke run: these figures are not the benchmark.**\n"] if opts.quick else []
    parts += [
        "## Added latency (sequential requests, 8-token prompt, 4 tokens out)\n",
        markdown_table(rows, [("path", "path"), ("p50", "p50 ms"), ("p99", "p99 ms")]),
        f"\nAdded by the gateway: non-streaming p50 {added['json']['p50']:.2f} ms, "
        f"p99 {added['json']['p99']:.2f} ms; streaming p50 {added['stream']['p50']:.2f} ms, "
        f"p99 {added['stream']['p99']:.2f} ms "
        "(targets: p50 <= 2 ms, p99 <= 8 ms).",
        f"\nThroughput, 32 concurrent clients: direct {d['throughput_rps']['direct']:.0f} req/s, "
        f"through one gateway process {d['throughput_rps']['gateway']:.0f} req/s (target >= 600).",
        "\nRelay delay per chunk (client arrival - backend send): direct p99 "
        f"{relay['direct_p99']:.2f} ms, gateway p99 {relay['gateway_p99']:.2f} ms; added "
        f"{relay['gateway_p99'] - relay['direct_p99']:.2f} ms (target <= 1 ms).",
        "\n## Overload: 3x capacity (120 req/s offered, ~40 req/s capacity), deadline 2 s\n",
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
        "\n## Fairness: one tenant at 10x the other's rate\n",
        markdown_table(
            [{"who": k, **v} for k, v in f.items()],
            [
                ("who", "tenant"),
                ("accepted", "accepted"),
                ("refused", "refused"),
                ("ttft_p50_ms", "TTFT p50 ms"),
                ("ttft_p99_ms", "TTFT p99 ms"),
            ],
        ),
        f"\nLight tenant p99 TTFT with the heavy one {fr:.2f}x its solo value (target <= 1.5x).",
    ]
    return "\n".join(parts)
