"""An open-loop load generator for a running stack (`switchyard load`).

Arrivals are Poisson at `rate_per_s` for `duration_s`, whatever the server does (open
loop: a slow server does not slow the offered load). Each request streams a chat
completion of one workload kind:

- `short`: a one-line question, 32 tokens out;
- `long`: a prompt of a few hundred words, 128 tokens out;
- `shared-prefix`: one long system prompt shared by all of these requests (prefix cache)
  and a short question, 64 tokens out.

`LoadStats` keeps per-request outcomes (TTFT, inter-token gaps, status, Retry-After of
refusals, the pool and route that served it) and summarises any recent window.
"""

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import msgspec

MIXES = ("short", "long", "shared-prefix")
_WORDS = (
    "switchyard routes requests across pools of model workers with quotas and queues "
    "every tenant gets a fair share while the cascade picks a small or a large model"
).split()
_SYSTEM = " ".join(_WORDS[i % len(_WORDS)] for i in range(600))


@dataclass
class Outcome:
    """One request, as the client saw it. Times in seconds from its arrival."""

    kind: str
    tenant: int
    arrived_s: float  # since the run started
    status: int = 0  # HTTP status; 0: no response (transport error)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    done_s: float | None = None  # arrival to the stream's end
    completion_tokens: int = 0
    retry_after_s: float | None = None  # on 429/503
    pool: str | None = None  # x-switchyard-model
    route: str | None = None  # x-switchyard-route
    error: str | None = None  # transport error or an in-band error event

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def build_request(kind: str, rng: random.Random, model: str) -> dict[str, Any]:
    if kind == "short":
        messages = [{"role": "user", "content": f"Question {rng.randrange(10**6)}: say hi."}]
        max_tokens = 32
    elif kind == "long":
        words = " ".join(rng.choice(_WORDS) for _ in range(400))
        messages = [{"role": "user", "content": f"Summarise this: {words}"}]
        max_tokens = 128
    elif kind == "shared-prefix":
        messages = [
            {"role": "system", "content": _SYSTEM},
            {"role": "user", "content": f"Question {rng.randrange(10**6)}: one line, please."},
        ]
        max_tokens = 64
    else:
        raise ValueError(f"unknown workload kind {kind!r}; expected some of {MIXES}")
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def arrival_times(rate_per_s: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrival instants in [0, duration_s)."""
    out, t = [], 0.0
    if rate_per_s <= 0:
        return out
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return out
        out.append(t)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(math.ceil(q / 100 * len(ordered))) - 1, len(ordered) - 1)]


class LoadStats:
    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.inflight = 0

    def window(self, now_s: float, window_s: float) -> dict[str, Any]:
        """Offered and served rates, latency percentiles and refusals over the window."""
        recent = [o for o in self.outcomes if now_s - o.arrived_s <= window_s]
        done = [
            o
            for o in self.outcomes
            if o.done_s is not None and now_s - (o.arrived_s + o.done_s) <= window_s
        ]
        span = max(min(window_s, now_s), 1e-9)
        return summarise(recent, done, span) | {"inflight": self.inflight}

    def report(self, elapsed_s: float, duration_s: float) -> dict[str, Any]:
        """The whole run; the offered rate is over the arrivals' `duration_s`, the served
        rate over `elapsed_s` (until the last request ended)."""
        done = [o for o in self.outcomes if o.done_s is not None]
        out = summarise(self.outcomes, done, max(elapsed_s, 1e-9))
        out["offered_per_s"] = round(len(self.outcomes) / max(duration_s, 1e-9), 3)
        out["by_kind"] = {
            kind: summarise(
                [o for o in self.outcomes if o.kind == kind],
                [o for o in done if o.kind == kind],
                max(elapsed_s, 1e-9),
            )
            for kind in sorted({o.kind for o in self.outcomes})
        }
        return out


def summarise(offered: list[Outcome], done: list[Outcome], span_s: float) -> dict[str, Any]:
    served = [o for o in done if o.ok]
    refused = [o for o in done if o.status in (429, 503)]
    ttft = [o.ttft_s for o in served if o.ttft_s is not None]
    itl = [g for o in served for g in o.itl_s]
    routes: dict[str, int] = {}
    for o in served:
        key = f"{o.pool}/{o.route}"
        routes[key] = routes.get(key, 0) + 1
    return {
        "offered": len(offered),
        "offered_per_s": round(len(offered) / span_s, 3),
        "served": len(served),
        "served_per_s": round(len(served) / span_s, 3),
        "failed": sum(1 for o in done if not o.ok and o.status not in (429, 503)),
        "refused": len(refused),
        "retry_after_s_max": max((o.retry_after_s or 0 for o in refused), default=None),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "completion_tokens": sum(o.completion_tokens for o in served),
        "routes": routes,
    }


async def one_request(
    http: httpx.AsyncClient, base_url: str, key: str, body: dict, outcome: Outcome
) -> None:
    t0 = time.perf_counter()
    headers = {"authorization": f"Bearer {key}"}
    try:
        async with http.stream(
            "POST", f"{base_url}/chat/completions", json=body, headers=headers
        ) as r:
            outcome.status = r.status_code
            outcome.pool = r.headers.get("x-switchyard-model")
            outcome.route = r.headers.get("x-switchyard-route")
            if r.status_code != 200:
                retry = r.headers.get("retry-after")
                outcome.retry_after_s = float(retry) if retry else None
                await r.aread()
                return
            last = None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = msgspec.json.decode(line[6:])
                if "error" in event:
                    outcome.error = str(event["error"].get("message"))
                    continue
                if event.get("usage"):
                    outcome.completion_tokens = event["usage"].get("completion_tokens", 0)
                if not any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                    continue
                now = time.perf_counter()
                if last is None:
                    outcome.ttft_s = now - t0
                else:
                    outcome.itl_s.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        outcome.error = repr(exc)
    finally:
        outcome.done_s = time.perf_counter() - t0


@dataclass
class LoadOptions:
    base_url: str  # ends in /v1
    keys: list[str]  # one API key per tenant
    rate_per_s: float = 5.0
    duration_s: float = 30.0
    mix: tuple[str, ...] = MIXES
    model: str = "auto"
    seed: int = 0
    timeout_s: float = 120.0
    # How often each kind of `mix` is picked (relative); None: uniformly.
    weights: tuple[float, ...] | None = None
    # False: a new connection per request (llama-server may close a kept-alive one right
    # after a stream, failing the next request before any byte; docs/benchmarks/peers.md).
    keepalive: bool = True


def pick_kind(opts: LoadOptions, rng: random.Random) -> str:
    """One request's kind: uniform over `opts.mix`, or by `opts.weights`."""
    if opts.weights is None:
        return rng.choice(opts.mix)
    return rng.choices(opts.mix, weights=opts.weights)[0]


async def run_load(
    opts: LoadOptions, stats: LoadStats, on_tick: Callable[[float], Any] | None = None
) -> float:
    """Offer the load; returns the elapsed seconds once every request has ended."""
    if opts.weights is not None and len(opts.weights) != len(opts.mix):
        raise ValueError(f"{len(opts.weights)} weights for {len(opts.mix)} kinds of request")
    rng = random.Random(opts.seed)
    schedule = arrival_times(opts.rate_per_s, opts.duration_s, rng)
    keepalive = 256 if opts.keepalive else 0
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=keepalive)
    start = time.perf_counter()
    tasks: set[asyncio.Task] = set()

    async def fire(at: float) -> None:
        tenant = rng.randrange(len(opts.keys))
        kind = pick_kind(opts, rng)
        outcome = Outcome(kind, tenant, at)
        stats.outcomes.append(outcome)
        stats.inflight += 1
        try:
            body = build_request(kind, rng, opts.model)
            await one_request(http, opts.base_url, opts.keys[tenant], body, outcome)
        finally:
            stats.inflight -= 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(opts.timeout_s), limits=limits) as http:
        ticker = asyncio.ensure_future(_tick(on_tick, start)) if on_tick else None
        try:
            for at in schedule:
                delay = at - (time.perf_counter() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.ensure_future(fire(at))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
            if ticker is not None:
                ticker.cancel()
    return time.perf_counter() - start


async def _tick(on_tick: Callable[[float], Any], start: float) -> None:
    while True:
        result = on_tick(time.perf_counter() - start)
        if asyncio.iscoroutine(result):
            await result
        await asyncio.sleep(0.5)


def report_dict(opts: LoadOptions, stats: LoadStats, elapsed_s: float, fleet: list) -> dict:
    return {
        "options": {k: v for k, v in asdict(opts).items() if k != "keys"}
        | {"tenants": len(opts.keys)},
        "elapsed_s": round(elapsed_s, 3),
        "summary": stats.report(elapsed_s, opts.duration_s),
        "fleet_samples": fleet,  # (t, {pool: replicas, queue}) seen during the run
        "outcomes": [asdict(o) for o in stats.outcomes],  # every request, as the client saw it
    }
