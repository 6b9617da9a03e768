"""The load `switchyard bench foreign` puts on llama-server, directly and through the
gateway: sequential requests alternating between the two (added latency, the gateway's
CPU per request), and a burst of concurrent streams beyond the server's slots."""

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import httpx

from benchmarks.wrk import cpu_seconds

SHORT_PROMPT = "The capital of France is"
# Greedy, this prompt counts on well past 128 tokens: the burst's streams run their whole
# max_tokens (no early end of sequence) without an ignore_eos the gateway may not pass.
LONG_PROMPT = "Count from 1 to 200: 1, 2, 3,"


@dataclass
class Target:
    """One way to reach the llama-server: directly or through the gateway."""

    name: str  # "direct" | "gateway"
    url: str  # base URL; requests go to url + /v1/completions
    model: str  # what requests put in "model"
    headers: dict[str, str] = field(default_factory=dict)  # the bearer token, if any
    pids: list[int] = field(default_factory=list)  # the process whose CPU is counted


def short_body(model: str, max_tokens: int, stream: bool) -> dict:
    return {
        "model": model,
        "prompt": SHORT_PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def _one(client: httpx.Client, body: dict) -> float:
    """Seconds for one whole request (a stream read to its end). llama-server often
    closes the connection after a stream; a request sent on it before the close is seen
    fails without an answer, and is sent again (on a new connection), timed from there."""
    try:
        return _timed(client, body)
    except httpx.RemoteProtocolError:
        return _timed(client, body)


def _timed(client: httpx.Client, body: dict) -> float:
    t0 = time.perf_counter()
    if body["stream"]:
        with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for _ in r.iter_bytes():
                pass
    else:
        client.post("/v1/completions", json=body).raise_for_status()
    return time.perf_counter() - t0


def alternating(
    direct: Target, gateway: Target, num_pairs: int, max_tokens: int, stream: bool
) -> dict:
    """`num_pairs` rounds of one request to each target, one at a time, the order flipped
    each round (ABBA) so neither always runs second. Returns the seconds of each target's
    requests, the CPU seconds the gateway's processes spent inside its own requests'
    windows (summed per request, so the direct requests' time is not charged to it), and
    per target the requests that failed (not timed) with the first error."""
    out: dict = {"direct": [], "gateway": [], "gateway_cpu_s": 0.0, "gateway_wall_s": 0.0}
    out["errors"] = {"direct": 0, "gateway": 0}
    out["first_error"] = {}
    with (
        httpx.Client(base_url=direct.url, headers=direct.headers, timeout=60) as dc,
        httpx.Client(base_url=gateway.url, headers=gateway.headers, timeout=60) as gc,
    ):
        pair = ((direct, dc), (gateway, gc))
        for i in range(num_pairs):
            for target, client in pair if i % 2 == 0 else pair[::-1]:
                body = short_body(target.model, max_tokens, stream)
                c0 = cpu_seconds(gateway.pids)
                try:
                    dt = _one(client, body)
                except httpx.HTTPError as e:
                    out["errors"][target.name] += 1
                    out["first_error"].setdefault(target.name, f"{type(e).__name__}: {e}"[:300])
                    continue
                if target is gateway:
                    out["gateway_cpu_s"] += cpu_seconds(gateway.pids) - c0
                    out["gateway_wall_s"] += dt
                out[target.name].append(dt)
    return out


def idle_cores(pids: list[int], duration_s: float) -> float:
    """Cores the processes use while nothing is asked of them (the gateway's polling)."""
    c0 = cpu_seconds(pids)
    time.sleep(duration_s)
    return (cpu_seconds(pids) - c0) / duration_s


@dataclass
class StreamResult:
    """One stream of a burst, as the client saw it."""

    status: int | None  # HTTP status; None: the connection failed
    retry_after: bool  # a Retry-After header came with a refusal
    ttft_s: float | None  # arrival of the first token event; None: no token came
    num_chunks: int  # token events received
    total_s: float
    error_in_band: bool = False  # the first event was an error (refused after the 200)


async def _stream(session: aiohttp.ClientSession, target: Target, body: bytes) -> StreamResult:
    hdrs = {**target.headers, "content-type": "application/json"}
    t0 = time.perf_counter()
    try:
        async with session.post(f"{target.url}/v1/completions", data=body, headers=hdrs) as r:
            if r.status != 200:
                await r.read()
                return StreamResult(
                    r.status, "retry-after" in r.headers, None, 0, time.perf_counter() - t0
                )
            ttft, chunks, in_band = None, 0, False
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                if ttft is None:
                    if b'"error"' in line:
                        in_band = True
                        break
                    ttft = time.perf_counter() - t0
                chunks += 1
            return StreamResult(200, False, ttft, chunks, time.perf_counter() - t0, in_band)
    except (aiohttp.ClientError, TimeoutError):
        return StreamResult(None, False, None, 0, time.perf_counter() - t0)


async def _burst(target: Target, num_streams: int, max_tokens: int) -> list[StreamResult]:
    body = json.dumps(
        {
            "model": target.model,
            "prompt": LONG_PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(
            await asyncio.gather(*(_stream(session, target, body) for _ in range(num_streams)))
        )


def burst(target: Target, num_streams: int, max_tokens: int) -> tuple[list[StreamResult], float]:
    """`num_streams` streaming requests sent at once; their results and the burst's wall
    seconds (first sent to last finished)."""
    t0 = time.perf_counter()
    results = asyncio.run(_burst(target, num_streams, max_tokens))
    return results, time.perf_counter() - t0
