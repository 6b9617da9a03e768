"""`switchyard bench worker`: the engine workload over HTTP (streaming) vs in-process."""

import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from tqdm import tqdm

from benchmarks.engine_bench import BenchOptions, _run_child, make_bench_checkpoint, make_workload
from benchmarks.engine_systems import WORKSPACE_GIB
from benchmarks.processes import child_process, free_port, wait_http
from benchmarks.stats import (
    LATENCY_COLUMNS,
    latency_summary,
    markdown_table,
    percentile,
    write_report,
)

log = logging.getLogger(__name__)


def _engine_section(work: list[tuple[list[int], int]], budget: int) -> dict:
    """The worker's engine as the in-process side builds it (`engine_systems._engine`),
    so that the two differ by HTTP alone (the worker's default workspace holds 16 rows of
    the bench model in fp32: 48 of the 64 streams would decode from the paged cache)."""
    need = sum(len(p) + n for p, n in work)
    return {
        "decode_workspace_gib": WORKSPACE_GIB,
        "num_kv_blocks": need // 16 + 64,
        "scheduler": {"max_num_seqs": len(work), "max_num_batched_tokens": budget},
    }


async def _stream_one(
    client: httpx.AsyncClient, prompt: list[int], n: int
) -> tuple[float, list[float], int]:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            # Parse only the usage chunk: the client shares this machine's two cores with
            # the worker, so it does as little per token as it can.
            if '"usage"' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            elif '"finish_reason":null' in line:
                stamps.append(time.perf_counter())  # the worker sends one chunk per token
    return t0, stamps, tokens


_TTFT_METRIC = "switchyard_worker_time_to_first_token_seconds"


async def _server_ttft(client: httpx.AsyncClient) -> tuple[float, float]:
    """(sum, count) of the worker's own TTFT histogram: from the engine taking the request
    to its first token."""
    text = (await client.get("/metrics")).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(_TTFT_METRIC + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(_TTFT_METRIC + "_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


async def _probe_http(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Unloaded TTFT over HTTP: one streaming request at a time. `http_added_mean_ms`:
    what the serving layer adds to the same requests (HTTP, the handler, the hand-over to
    the engine thread and back, SSE): their mean TTFT at the client minus the mean the
    engine measured from taking each request to its first token, so the engine's own time
    and its noise cancel out."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await _stream_one(client, prompts[0], 2)  # warm-up
        sum0, n0 = await _server_ttft(client)
        ttft = []
        for p in prompts:
            t0, stamps, _ = await _stream_one(client, p, max_tokens)
            ttft.append(stamps[0] - t0)
        sum1, n1 = await _server_ttft(client)
    out = {"ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3}
    if n1 - n0 == len(ttft):
        server_mean = (sum1 - sum0) / (n1 - n0)
        out["http_added_mean_ms"] = (sum(ttft) / len(ttft) - server_mean) * 1e3
    return out


async def _drive_http(url: str, work: list[tuple[list[int], int]]) -> dict:
    limits = httpx.Limits(max_connections=len(work) + 4, max_keepalive_connections=len(work) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await _stream_one(client, work[0][0][:32], 4)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_stream_one(client, p, n) for p, n in work))
        elapsed = time.perf_counter() - t0
    ttft = [stamps[0] - start for start, stamps, _ in results]
    itl = [b - a for _, stamps, _ in results for a, b in zip(stamps, stamps[1:], strict=False)]
    n = sum(t for _, _, t in results)
    return {
        "output_tokens": n,
        "elapsed_s": elapsed,
        "tokens_per_s": n / elapsed,
        **latency_summary(ttft, itl),
    }


def run_http(
    ckpt: Path, work: list[tuple[list[int], int]], budget: int, tmp: Path, probe: list[list[int]]
) -> dict:
    port = free_port()
    cfg = tmp / "worker.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "engine": _engine_section(work, budget),
                "worker": {"max_waiting_requests": 1024, "max_waiting_prompt_tokens": 10**8},
            }
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "cli.main",
        "worker",
        "--model",
        str(ckpt),
        "--port",
        str(port),
        "--config",
        str(cfg),
        "--served-model-name",
        "bench",
    ]
    log_path = tmp / "worker.log"
    with child_process(cmd, log_path) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(url, "/ready", proc=proc, log_path=log_path)
        out = asyncio.run(_drive_http(url, work))
        out["unloaded"] = asyncio.run(_probe_http(url, probe, 8))
        return out


def run_worker_bench(opts: BenchOptions) -> dict:
    ckpt = make_bench_checkpoint(opts.out_dir / "bench-model")
    work = make_workload(opts.num_requests, opts.seed, opts.quick)
    # Unloaded probe: 20 different 128-token prompts (no prefix-cache hits), one at a time.
    probe = [[(7 * i + j) % 8000 + 3 for j in range(128)] for i in range(20)]
    budget = 2048
    results = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        steps = tqdm(total=2, desc="bench worker", unit="run")
        results["in_process"] = _run_child(
            "switchyard", {"ckpt": str(ckpt), "workload": work, "budget": budget}, tmp
        )
        probe_spec = {"ckpt": str(ckpt), "prompts": probe, "max_tokens": 8}
        results["in_process"]["unloaded"] = _run_child("ttft_probe", probe_spec, tmp)
        steps.update()
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        results["http"] = run_http(ckpt, work, budget, tmp, probe)
        steps.update()
        steps.close()
    ip, h = results["in_process"], results["http"]
    kept = h["tokens_per_s"] / ip["tokens_per_s"]
    added = h["unloaded"]["ttft_p50_ms"] - ip["unloaded"]["ttft_p50_ms"]
    http_added = h["unloaded"].get("http_added_mean_ms")
    data = {
        "results": results,
        "throughput_kept": kept,
        "ttft_p50_added_ms": added,
        "ttft_added_by_http_mean_ms": http_added,
        "options": {"num_requests": opts.num_requests, "quick": opts.quick},
    }
    rows = [
        {"system": "in-process engine", **ip, "unloaded_ttft": ip["unloaded"]["ttft_p50_ms"]},
        {
            "system": "worker over HTTP (SSE, concurrent clients)",
            **h,
            "unloaded_ttft": h["unloaded"]["ttft_p50_ms"],
        },
    ]
    cols = [
        ("system", "system"),
        *LATENCY_COLUMNS,
        ("unloaded_ttft", "unloaded TTFT p50 ms"),
    ]
    md = "\n".join(
        ([("**Quick smoke run: these figures are not the benchmark.**\n")] if opts.quick else [])
        + [
            f"## Worker: {opts.num_requests} streaming requests over HTTP vs in-process\n",
            markdown_table(rows, cols),
            f"\nHTTP keeps {kept:.1%} of in-process throughput (target >= 90%). Unloaded TTFT "
            "(one 128-token request at a time, 20 requests; target: HTTP adds <= 5 ms): "
            + (
                f"HTTP adds {http_added:+.2f} ms on the same requests (their mean at the "
                "client minus the mean the engine measured from taking the request to its "
                "first token); "
                if http_added is not None
                else "the worker's own TTFT could not be read; "
            )
            + f"p50 against the in-process engine (another process): {added:+.1f} ms. Under "
            "the full burst TTFT is queueing.",
        ]
    )
    json_path, md_path = write_report(opts.out_dir, "worker", data, md)
    print(md)
    print(f"\nwrote {json_path} and {md_path}")
    return data
