"""The load `switchyard bench gateway` puts on each path: sequential latency and per-chunk
relay delay with a Python client, closed-loop throughput with wrk (and the CPU the path's
processes spend per request meanwhile), and the open-loop load of the overload and
fairness scenarios."""

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx

from benchmarks.gateway_paths import BenchPath
from benchmarks.stats import percentile
from benchmarks.wrk import cpu_seconds, run_wrk, wrk_path

BODY = {"model": "small", "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 4}
# What wrk sends: plain (4 tokens, one JSON answer) and streaming (16 SSE chunks).
WRK_BODIES = {"plain": BODY, "stream": {**BODY, "max_tokens": 16, "stream": True}}
CONNECTIONS = (16, 64)


@dataclass
class LoadPlan:
    """How much load each path gets."""

    num_sequential: int = 500  # requests per mode for the unloaded latency
    num_relay_streams: int = 20  # 32-token streams for the relay delay
    wrk_duration_s: float = 10.0  # per (mode, connections) cell
    wrk_warmup_s: float = 2.0  # one unrecorded run first; 0: none


def measure_path(path: BenchPath, plan: LoadPlan) -> dict[str, Any]:
    """Unloaded latency, relay delay, then the wrk cells; a part that fails is an
    {"error": ...} in its place, the rest still runs."""
    out: dict[str, Any] = {}
    try:
        out["latency_ms"] = {
            mode: _p50_p99(asyncio.run(_latencies(path, plan.num_sequential, mode == "stream")))
            for mode in ("plain", "stream")
        }
    except Exception as e:  # noqa: BLE001 (reported as the row's error)
        out["latency_ms"] = {"error": _err(e)}
    try:
        delays = asyncio.run(_relay_delays(path, plan.num_relay_streams))
        out["relay_delay_ms"] = {**_p50_p99(delays), "chunks": len(delays)}
    except Exception as e:  # noqa: BLE001
        out["relay_delay_ms"] = {"error": _err(e)}
    out["wrk"] = wrk_cells(path, plan)
    return out


def wrk_cells(path: BenchPath, plan: LoadPlan) -> list[dict[str, Any]]:
    """One row per (mode, connections): wrk's figures, the CPU milliseconds per request of
    the path's processes (and of its shared helpers), and the share of a core wrk used."""
    if wrk_path() is None:
        return []
    if plan.wrk_warmup_s:
        try:
            run_wrk(*_wrk_target(path, "plain"), connections=64, duration_s=plan.wrk_warmup_s)
        except Exception:  # noqa: BLE001, S110 (the measured runs report what is wrong)
            pass
    rows = []
    for mode in WRK_BODIES:
        for conns in CONNECTIONS:
            row: dict[str, Any] = {"mode": mode, "connections": conns}
            try:
                c0, e0 = cpu_seconds(path.pids), cpu_seconds(path.extra_pids)
                r = run_wrk(
                    *_wrk_target(path, mode), connections=conns, duration_s=plan.wrk_duration_s
                )
                c1, e1 = cpu_seconds(path.pids), cpu_seconds(path.extra_pids)
                if r.requests == 0 or r.duration_s <= 0:
                    raise RuntimeError(
                        f"no request completed in the {plan.wrk_duration_s:.0f} s run "
                        "(each took longer at this concurrency)"
                    )
                n = r.requests
                row |= {
                    "rps": r.rps,
                    "p50_ms": r.p50_ms,
                    "p99_ms": r.p99_ms,
                    "requests": r.requests,
                    "errors": r.errors,
                    "cpu_ms_per_request": (c1 - c0) * 1e3 / n if path.pids else math.nan,
                    "extra_cpu_ms_per_request": (
                        (e1 - e0) * 1e3 / n if path.extra_pids else math.nan
                    ),
                    "path_cores": (c1 - c0) / r.duration_s if path.pids else math.nan,
                    "wrk_cores": r.cpu_s / r.duration_s,
                }
            except Exception as e:  # noqa: BLE001
                row["error"] = _err(e)
            rows.append(row)
    return rows


def _wrk_target(path: BenchPath, mode: str) -> tuple[str, dict, dict[str, str]]:
    return (
        f"{path.url}/v1/completions",
        {**WRK_BODIES[mode], "model": path.model},
        path.headers,
    )


def _p50_p99(xs_s: list[float]) -> dict[str, float]:
    return {"p50": percentile(xs_s, 50) * 1e3, "p99": percentile(xs_s, 99) * 1e3}


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


async def _latencies(path: BenchPath, n: int, stream: bool) -> list[float]:
    out = []
    body = {**BODY, "model": path.model, **({"stream": True} if stream else {})}
    async with httpx.AsyncClient(base_url=path.url, headers=path.headers, timeout=30) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            if stream:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for _ in r.aiter_bytes():
                        pass
            else:
                (await c.post("/v1/completions", json=body)).raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


async def _relay_delays(path: BenchPath, n: int) -> list[float]:
    """Per chunk: arrival at the client minus the backend's send time (`sent_at` in the
    chunk; a path that re-serialises chunks drops it, and yields no values)."""
    out = []
    body = {**BODY, "model": path.model, "max_tokens": 32, "stream": True}
    async with httpx.AsyncClient(base_url=path.url, headers=path.headers, timeout=30) as c:
        for _ in range(n):
            async with c.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"sent_at"' in line:
                        out.append(time.time() - json.loads(line[6:])["sent_at"])
    return out


SLOW_BODY = {**BODY, "max_tokens": 20, "stream": True}  # 20 tokens x 10 ms: 0.2 s of service


async def open_loop(url: str, keys: dict[str, float], duration_s: float, deadline_s: float) -> dict:
    """Offered load per tenant key (requests/s, Poisson-free fixed spacing): TTFT of
    accepted streams, refusals and whether each carried Retry-After, deadline misses.

    On aiohttp, not httpx: at 176 streams/s of 20 chunks an httpx client took a whole core
    here and its own lateness was most of the TTFT it measured. `client_cores` in the
    result says how busy this process was (near 1: the figures are the client's)."""
    results: dict[str, Any] = {
        k: {"ttft": [], "refused": 0, "no_retry_after": 0, "late": 0, "failed": 0} for k in keys
    }
    body = json.dumps(SLOW_BODY).encode()
    connector = aiohttp.TCPConnector(limit=4000, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=deadline_s + 60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(key: str) -> None:
            res = results[key]
            t0 = time.perf_counter()
            hdrs = {
                "authorization": f"Bearer {key}",
                "x-request-timeout": str(deadline_s),
                "content-type": "application/json",
            }
            try:
                async with session.post(f"{url}/v1/completions", data=body, headers=hdrs) as r:
                    if r.status != 200:
                        res["refused"] += 1
                        res["no_retry_after"] += "retry-after" not in r.headers
                        return
                    first = True
                    # Read the whole stream: the request holds its worker slot until done.
                    async for piece in r.content.iter_any():
                        if first and b"data: {" in piece:
                            first = False
                            if b'"error"' in piece:
                                res["refused"] += 1
                                return
                            ttft = time.perf_counter() - t0
                            res["ttft"].append(ttft)
                            res["late"] += ttft > deadline_s
            except (aiohttp.ClientError, TimeoutError):
                res["failed"] += 1

        tasks = []
        c0, start = time.process_time(), time.perf_counter()
        next_at = {k: start for k in keys}
        while time.perf_counter() - start < duration_s:
            now = time.perf_counter()
            for key, rate in keys.items():
                while next_at[key] <= now:
                    tasks.append(asyncio.ensure_future(one(key)))
                    next_at[key] += 1.0 / rate
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks, return_exceptions=True)
        client_cores = (time.process_time() - c0) / (time.perf_counter() - start)
    for res in results.values():
        res["client_cores"] = client_cores
    return results


def summarise_open_loop(res: dict) -> dict:
    t = res["ttft"]
    return {
        "accepted": len(t),
        "refused": res["refused"],
        "refusals_without_retry_after": res["no_retry_after"],
        "served_past_deadline": res["late"],
        "failed": res.get("failed", 0),
        "ttft_p50_ms": percentile(t, 50) * 1e3,
        "ttft_p99_ms": percentile(t, 99) * 1e3,
        "client_cores": res.get("client_cores", math.nan),
    }
