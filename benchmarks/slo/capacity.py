"""Capacity, measured first: what the stack completes per second with a fixed number of
streams always in flight (closed loop), the unit the sweep's levels are multiples of."""

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from benchmarks.loadgen import LoadOptions, Outcome, build_request, one_request, pick_kind
from benchmarks.slo.plan import Mix


@dataclass(frozen=True)
class Capacity:
    requests_per_s: float  # completed without error in the window, per second
    num_ok: int  # those requests
    num_refused: int  # 429/503 answers in the window (each user then waits Retry-After)
    num_failed: int  # anything else that ended in the window
    concurrency: int
    warmup_s: float  # not counted: first requests, an empty prefix cache
    window_s: float


def capacity_from(
    done: list[tuple[float, Outcome]], *, concurrency: int, warmup_s: float, window_s: float
) -> Capacity:
    """The closed loop's figures from `(end time since start, outcome)` pairs: requests
    that ended inside [warmup_s, warmup_s + window_s], per second of the window."""
    inside = [o for t, o in done if warmup_s <= t <= warmup_s + window_s]
    ok = sum(1 for o in inside if o.ok)
    refused = sum(1 for o in inside if o.status in (429, 503))
    return Capacity(
        requests_per_s=round(ok / window_s, 3),
        num_ok=ok,
        num_refused=refused,
        num_failed=len(inside) - ok - refused,
        concurrency=concurrency,
        warmup_s=warmup_s,
        window_s=window_s,
    )


async def measure_capacity(
    base_url: str,
    keys: list[str],
    mix: Mix,
    *,
    concurrency: int = 8,
    warmup_s: float = 3.0,
    window_s: float = 15.0,
    seed: int = 0,
) -> Capacity:
    """`concurrency` users, each sending the mix's next request as soon as its last one
    ended (after a refusal: once its Retry-After passed, 0.1-2 s). Requests still in
    flight when the window closes are cancelled, not counted."""
    rng = random.Random(seed)
    opts = LoadOptions(base_url, keys, mix=mix.kinds, weights=mix.weights, model=mix.model)
    done: list[tuple[float, Outcome]] = []
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    start = time.perf_counter()

    async def user(i: int) -> None:
        while True:
            kind = pick_kind(opts, rng)
            o = Outcome(kind, i % len(keys), time.perf_counter() - start)
            body = build_request(kind, rng, mix.model)
            await one_request(http, base_url, keys[o.tenant], body, o)
            done.append((time.perf_counter() - start, o))
            if o.status in (429, 503):
                await asyncio.sleep(min(max(o.retry_after_s or 0.5, 0.1), 2.0))
            elif not o.ok:
                await asyncio.sleep(0.5)

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as http:
        tasks = [asyncio.ensure_future(user(i)) for i in range(concurrency)]
        await asyncio.wait(tasks, timeout=warmup_s + window_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return capacity_from(done, concurrency=concurrency, warmup_s=warmup_s, window_s=window_s)
