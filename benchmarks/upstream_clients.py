"""Upstream HTTP clients side by side: the CPU one gateway process spends per request to a
worker, for the clients the gateway could use (`switchyard bench upstream`).

Each client sends the same POST to the same fast fake backend (a child process) from 16
concurrent tasks on one event loop, plain and streaming (16 chunks, read to the end); the
figure is this process's CPU time (user + system) per request, so the backend's own cost is
not in it. Run it on a quiet machine: the clients take turns, and ratios between them in one
run are what to read.
"""

import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from tqdm import tqdm

from benchmarks.processes import child_process, free_port, wait_http
from benchmarks.stats import markdown_table, write_report
from workers.api.client import WorkerClient

BODY = {"model": "small", "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 4}
STREAM_BODY = {**BODY, "max_tokens": 16, "stream": True}
CONCURRENCY = 16


@dataclass
class UpstreamBenchOptions:
    out_dir: Path
    requests: int = 4000
    quick: bool = False


async def _drive(send, n: int) -> tuple[float, float]:
    """Run `send()` n times from CONCURRENCY tasks: (CPU s, wall s)."""
    left = n

    async def loop() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await send()

    for _ in range(20):  # warm the pool
        await send()
    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))
    return time.process_time() - c0, time.perf_counter() - t0


async def _httpx(url: str, body: bytes, n: int) -> tuple[float, float]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=2.0), limits=limits) as c:
        headers = {"content-type": "application/json"}

        async def send() -> None:
            req = c.build_request("POST", url, content=body, headers=headers)
            r = await c.send(req, stream=True)
            try:
                async for _ in r.aiter_raw():
                    pass
            finally:
                await r.aclose()
            assert r.status_code == 200

        return await _drive(send, n)


async def _aiohttp(url: str, body: bytes, n: int) -> tuple[float, float]:
    connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0)
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        skip_auto_headers=("user-agent",),
    ) as s:
        headers = {"content-type": "application/json"}

        async def send() -> None:
            async with s.post(url, data=body, headers=headers) as r:
                async for _ in r.content.iter_any():
                    pass
                assert r.status == 200

        return await _drive(send, n)


async def _http1(url: str, body: bytes, n: int) -> tuple[float, float]:
    """`WorkerClient.post`, as the gateway calls it (`workers.api.http1` for an http:// worker)."""
    worker, path = url.split("/v1/", 1)
    async with WorkerClient() as client:

        async def send() -> None:
            r = await client.post(worker, f"/v1/{path}", body, stream=True)
            try:
                async for _ in r.aiter_raw():
                    pass
            finally:
                r.close()
            assert r.status_code == 200

        return await _drive(send, n)


CLIENTS = {
    "httpx (as the gateway had it)": _httpx,
    "aiohttp": _aiohttp,
    "workers.api.http1 (the gateway's)": _http1,
}


def run_upstream_bench(opts: UpstreamBenchOptions) -> dict:
    n = 500 if opts.quick else opts.requests
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        backend = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "benchmarks.fake_backend", "--port", str(port)]
        with child_process(cmd, Path(tmp) / "backend.log"):
            wait_http(backend)
            url = f"{backend}/v1/completions"
            todo = [(c, m) for c in CLIENTS for m in ("plain", "stream")]
            for client, mode in tqdm(todo, desc="bench upstream", unit="case"):
                body = json.dumps(STREAM_BODY if mode == "stream" else BODY).encode()
                cpu_s, wall_s = asyncio.run(CLIENTS[client](url, body, n))
                rows.append(
                    {
                        "client": client,
                        "mode": mode,
                        "cpu_ms_per_request": cpu_s * 1e3 / n,
                        "requests_per_s": n / wall_s,
                    }
                )
    base = {r["mode"]: r["cpu_ms_per_request"] for r in rows if r["client"].startswith("httpx")}
    for r in rows:
        r["cpu_vs_httpx"] = r["cpu_ms_per_request"] / base[r["mode"]]
    data = {
        "options": {"requests": n, "concurrency": CONCURRENCY, "quick": opts.quick},
        "rows": rows,
    }
    md = "\n".join(
        [
            "**Quick smoke run: these figures are not the benchmark.**\n" if opts.quick else "",
            f"## Upstream clients: CPU per request in the calling process ({n} requests, "
            f"{CONCURRENCY} concurrent, fake backend)\n",
            markdown_table(
                rows,
                [
                    ("client", "client"),
                    ("mode", "mode"),
                    ("cpu_ms_per_request", "CPU ms/request"),
                    ("cpu_vs_httpx", "vs httpx"),
                    ("requests_per_s", "req/s"),
                ],
            ),
        ]
    )
    json_path, md_path = write_report(opts.out_dir, "upstream-clients", data, md)
    print(md)
    print(f"\nwrote {json_path} and {md_path}")
    return data
