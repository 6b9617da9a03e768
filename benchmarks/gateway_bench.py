"""`switchyard bench gateway`: the gateway in front of a fast fake backend, side by side with
the backend alone, a gateway of two processes and a peer gateway: added latency, wrk
throughput and CPU per request, relay delay; then overload and fairness of one gateway.

Paths: benchmarks/gateway_paths.py; load: benchmarks/gateway_load.py; report:
benchmarks/gateway_report.py.
"""

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.gateway_load import BODY, LoadPlan, measure_path, open_loop, summarise_open_loop
from benchmarks.gateway_paths import (
    BenchPath,
    PeerOptions,
    gateway_process,
    make_key,
    peer_path,
    switchyard_path,
    wait_ready,
)
from benchmarks.gateway_report import (
    added_latency,
    bottleneck_notes,
    gateway_markdown,
    money_overhead,
    scaling_ratio,
)
from benchmarks.processes import child_process, free_port
from benchmarks.stats import write_report
from benchmarks.wrk import cpu_seconds, run_wrk, wrk_path

# The throughput gateways admit up to this many requests per worker before queueing, above
# the 64 connections of the largest wrk cell: the runs measure relaying, not the queue, and
# one process is not held back where two (each with its own count) would not be.
THROUGHPUT_INFLIGHT = 256


@dataclass
class GatewayBenchOptions:
    out_dir: Path
    quick: bool = False
    overload_s: float = 60.0
    backend_port: int | None = None  # the comparison's fake backend; None: a free port
    peer: PeerOptions = field(default_factory=PeerOptions)


def load_plan(quick: bool) -> LoadPlan:
    if quick:
        return LoadPlan(num_sequential=50, num_relay_streams=5, wrk_duration_s=1, wrk_warmup_s=0)
    return LoadPlan()


@contextmanager
def fake_backend(
    tmp: Path, port: int | None = None, token_delay_s: float = 0.0
) -> Iterator[BenchPath]:
    """The fake backend as a child process; yields it as the `direct` path."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "benchmarks.fake_backend", "--port", str(port)]
    log_path = tmp / f"backend-{port}.log"
    with child_process([*cmd, "--token-delay-s", str(token_delay_s)], log_path) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, "/health", {}, 30.0, proc, log_path)
        yield BenchPath("direct", url, pids=[proc.pid])


@contextmanager
def bench_stack(tmp: Path, redis_url: str, token_delay_s: float = 0.0, **gateway_cfg):
    """A fake backend and a gateway process in front of it; yields (gateway, backend) URLs."""
    with ExitStack() as stack:
        backend = stack.enter_context(fake_backend(tmp, token_delay_s=token_delay_s)).url
        gw, _ = stack.enter_context(gateway_process(tmp, backend, redis_url, **gateway_cfg))
        yield gw, backend


# The money path: a price on the pool and a budget no request reaches, so each request
# reserves its worst-case cost, is checked against the budget and settles its real cost.
BENCH_PRICE = {"prompt_per_mtok": 0.5, "cached_per_mtok": 0.125, "completion_per_mtok": 1.5}
BENCH_BUDGET = {"period": "month", "hard": 1_000_000.0, "soft": 900_000.0}


def _path_plans(
    opts: GatewayBenchOptions, tmp: Path, backend: BenchPath, redis_url: str
) -> list[tuple[str, str, AbstractContextManager[BenchPath] | None]]:
    """(name, what, a context manager yielding the started path) in measuring order; None
    where the path was not asked for."""
    sy = {"max_inflight_per_worker": THROUGHPUT_INFLIGHT}
    peer = opts.peer
    peer_cm = peer_path(peer, backend.url, tmp) if peer.cmd or peer.url else None
    peer_what = (
        f"`{peer.cmd}`"
        if peer.cmd
        else (
            f"{peer.url} (started by hand)" if peer.url else "not measured (no --peer/--peer-cmd)"
        )
    )
    return [
        ("direct", f"fake backend alone, {backend.url}", _given(backend)),
        (
            "switchyard",
            "one gateway process",
            switchyard_path("switchyard", tmp, backend.url, redis_url, **sy),
        ),
        (
            "switchyard $",
            "one gateway process, the pool priced, the tenant under a money budget",
            switchyard_path(
                "switchyard $",
                tmp,
                backend.url,
                redis_url,
                budget=BENCH_BUDGET,
                **sy,
                prices={"small": BENCH_PRICE},
            ),
        ),
        (
            "switchyard x2",
            "gateway config `processes: 2`",
            switchyard_path("switchyard x2", tmp, backend.url, redis_url, processes=2, **sy),
        ),
        ("peer", peer_what, peer_cm),
    ]


@contextmanager
def _given(path: BenchPath) -> Iterator[BenchPath]:
    yield path


def compare_paths(opts: GatewayBenchOptions, tmp: Path, redis_url: str, steps: tqdm) -> dict:
    """Each path started in turn (one gateway running at a time) and measured."""
    plan = load_plan(opts.quick)
    if opts.peer.url and not opts.backend_port:
        print(
            "warning: --peer without --backend-port: the peer must be in front of this "
            "bench's fake backend, which is on a random port",
            file=sys.stderr,
        )
    paths: dict[str, dict[str, Any]] = {}
    with fake_backend(tmp, opts.backend_port) as backend:
        for name, what, cm in _path_plans(opts, tmp, backend, redis_url):
            paths[name] = {"what": what}
            if cm is None:
                paths[name]["error"] = "not measured"
            else:
                try:
                    with cm as path:
                        paths[name] |= measure_path(path, plan)
                except Exception as e:  # noqa: BLE001 (a path that fails is an error row)
                    paths[name]["error"] = f"{type(e).__name__}: {e}"[:600]
            steps.update()
    return {
        "paths": paths,
        "added_latency_ms": added_latency(paths),
        "scaling_x2_over_x1_c64": scaling_ratio(paths),
        "money_cpu_over_tokens": money_overhead(paths),
        "bottleneck_notes": bottleneck_notes(paths, os.cpu_count() or 1) if wrk_path() else [],
        "wrk": {
            "available": wrk_path() is not None,
            "note": "wrk is not installed (apt-get install wrk); no throughput or CPU figures",
            "duration_s": plan.wrk_duration_s,
        },
    }


# The bounded overload gateway's longest queue wait: under the backend's unloaded TTFT
# (~14 ms), so an accepted request waits at most about one service time. At 20 ms its
# accepted p99 TTFT was 1.9-2.4x the unloaded p99; at 10 ms, 1.4-1.6x, with as many
# requests served (752-755 against 766-768 in 20 s).
BOUNDED_MAX_WAIT_S = 0.01


MONEY_ROUNDS = 5
MONEY_RUN_S = 8.0
MONEY_CONNECTIONS = 16


def money_ab(tmp: Path, redis_url: str, rounds: int, run_s: float) -> dict:
    """The gateway CPU per request that prices and a money budget add, measured so that the
    machine's drift cancels: a gateway with token quotas alone and one priced with a
    budget, each started fresh and loaded in turn (plain requests, wrk), `rounds` times;
    the verdict is the median of the rounds' paired ratios."""
    if wrk_path() is None:
        return {"error": "wrk is not installed (apt-get install wrk)"}
    sy = {"max_inflight_per_worker": THROUGHPUT_INFLIGHT}
    rows: list[dict[str, float]] = []
    with fake_backend(tmp) as backend:
        for _ in range(rounds):
            row: dict[str, float] = {}
            for name, extra in (
                ("tokens", {}),
                ("money", {"budget": BENCH_BUDGET, "prices": {"small": BENCH_PRICE}}),
            ):
                with switchyard_path(name, tmp, backend.url, redis_url, **extra, **sy) as path:
                    target = (f"{path.url}/v1/completions", {**BODY, "stream": False}, path.headers)
                    run_wrk(*target, connections=MONEY_CONNECTIONS, duration_s=2.0)  # warm up
                    c0 = cpu_seconds(path.pids)
                    r = run_wrk(*target, connections=MONEY_CONNECTIONS, duration_s=run_s)
                    row[name] = (cpu_seconds(path.pids) - c0) * 1e3 / max(1, r.requests)
            rows.append(row)
    ratios = sorted(row["money"] / row["tokens"] - 1 for row in rows)
    return {
        "rounds": rows,
        "connections": MONEY_CONNECTIONS,
        "run_s": run_s,
        "median_added": ratios[len(ratios) // 2],
        "target_added": 0.05,
    }


def overload_and_fairness(tmp: Path, redis_url: str, overload_s: float, steps: tqdm) -> dict:
    # Overload: a backend with capacity ~ 8 in flight x (1 / 0.2 s) = 40 requests/s. Its
    # service time is fixed, so the 8 slots tend to free together every 0.2 s: a bound on
    # the queue's length alone lets a request wait up to a whole service time. The bounded
    # gateway also bounds the wait (queue_max_wait_s) near the unloaded TTFT.
    overload = {}
    for name, cfg in (
        ("bounded", {"queue_max_requests": 2, "queue_max_wait_s": BOUNDED_MAX_WAIT_S}),
        (
            "unbounded",
            {
                "queue_max_requests": 1_000_000,
                "queue_max_tokens": 10**12,
                "request_timeout_s": 3600,
            },
        ),
    ):
        with bench_stack(tmp, redis_url, token_delay_s=0.01, max_inflight_per_worker=8, **cfg) as (
            gw,
            _,
        ):
            key = make_key(gw, f"over-{name}")
            solo = asyncio.run(open_loop(gw, {key: 10.0}, min(overload_s, 10.0), 2.0))[key]
            loaded = asyncio.run(
                open_loop(gw, {key: 120.0}, overload_s, 2.0 if name == "bounded" else 3600)
            )[key]
            overload[name] = {
                "unloaded": summarise_open_loop(solo),
                "overloaded": summarise_open_loop(loaded),
            }
    overload["bounded"]["max_wait_s"] = BOUNDED_MAX_WAIT_S
    steps.update()
    # Fairness, saturated: capacity 32 in flight / 0.2 s = 160 req/s; offered 16 + 160.
    with bench_stack(
        tmp, redis_url, token_delay_s=0.01, max_inflight_per_worker=32, queue_max_requests=256
    ) as (gw, _):
        heavy, light = make_key(gw, "heavy"), make_key(gw, "light")
        run_s = min(overload_s, 15.0)
        solo = asyncio.run(open_loop(gw, {light: 16.0}, run_s, 30.0))[light]
        both = asyncio.run(open_loop(gw, {light: 16.0, heavy: 160.0}, run_s, 30.0))
        fairness = {
            "light_solo": summarise_open_loop(solo),
            "light_with_heavy": summarise_open_loop(both[light]),
            "heavy": summarise_open_loop(both[heavy]),
        }
    steps.update()
    return {
        "overload": overload,
        "fairness": fairness,
        "fairness_cpu_saturated": fairness_cpu_saturated(tmp, redis_url, min(overload_s, 10.0)),
    }


def fairness_cpu_saturated(tmp: Path, redis_url: str, run_s: float) -> dict:
    """The gateway's own CPU saturated: a heavy tenant from wrk (64 connections, plain
    requests as fast as they are answered, far more than one gateway process relays), a
    light tenant at 16 streams/s; the light tenant's TTFT against its solo value. Without
    wrk: skipped."""
    if wrk_path() is None:
        return {"skipped": "wrk is not installed (apt-get install wrk)"}
    with bench_stack(
        tmp,
        redis_url,
        token_delay_s=0.01,
        max_inflight_per_worker=THROUGHPUT_INFLIGHT,
        queue_max_requests=1024,
    ) as (gw, _):
        heavy, light = make_key(gw, "heavy-cpu"), make_key(gw, "light-cpu")
        solo = asyncio.run(open_loop(gw, {light: 16.0}, run_s, 30.0))[light]
        url, body, headers = f"{gw}/v1/completions", BODY, {"authorization": f"Bearer {heavy}"}
        with ThreadPoolExecutor(1) as pool:
            flood = pool.submit(run_wrk, url, body, headers, connections=64, duration_s=run_s + 2)
            time.sleep(1.0)  # the flood is on before the light tenant's run starts
            both = asyncio.run(open_loop(gw, {light: 16.0}, run_s, 30.0))[light]
            heavy_run = flood.result()
    return {
        "light_solo": summarise_open_loop(solo),
        "light_with_heavy": summarise_open_loop(both),
        "heavy": {
            "requests": heavy_run.requests,
            "refused_or_failed": heavy_run.errors,
            "served_per_s": (heavy_run.requests - heavy_run.errors) / heavy_run.duration_s,
        },
    }


def run_gateway_bench(opts: GatewayBenchOptions) -> dict:
    from gateway.runtime.embedded_redis import EmbeddedRedis

    overload_s = 3.0 if opts.quick else opts.overload_s
    data: dict = {
        "options": {
            "quick": opts.quick,
            "overload_s": overload_s,
            "cpu_count": os.cpu_count(),
            "throughput_max_inflight_per_worker": THROUGHPUT_INFLIGHT,
            "peer": {"cmd": opts.peer.cmd, "url": opts.peer.url, "model": opts.peer.model},
        }
    }
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        redis = EmbeddedRedis(tmp / "redis")
        steps = tqdm(total=8, desc="bench gateway", unit="scenario")
        try:
            t0 = time.perf_counter()
            data |= compare_paths(opts, tmp, redis.url, steps)
            t1 = time.perf_counter()
            data |= overload_and_fairness(tmp, redis.url, overload_s, steps)
            t2 = time.perf_counter()
            rounds = 1 if opts.quick else MONEY_ROUNDS
            data["money_ab"] = money_ab(tmp, redis.url, rounds, 2.0 if opts.quick else MONEY_RUN_S)
            steps.update()
            data["elapsed_s"] = {
                "paths": t1 - t0,
                "overload_and_fairness": t2 - t1,
                "money_ab": time.perf_counter() - t2,
            }
        finally:
            steps.close()
            redis.close()
    md = gateway_markdown(data, opts.quick)
    json_path, md_path = write_report(opts.out_dir, "gateway", data, md)
    print(md)
    print(f"\nwrote {json_path} and {md_path}")
    return data
