"""`switchyard bench engine --tensor-parallel N`: the engine with its model split over N
ranks beside N = 1, same checkpoint, same workload, each run in its own process.

On a CPU the ranks share the machine's cores (N = 1 gets all of them, each of N ranks a
1/N share), so the comparison measures what sharding costs per step (the step broadcast,
two all-reduces per layer, the logits gather), not a speed-up: tensor parallelism pays
where the model does not fit one device, or where N devices add memory bandwidth.

`python -m benchmarks.engine_tp SPEC_JSON OUT_JSON` runs one configuration.
"""

import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.engine_bench import make_bench_checkpoint, make_workload
from benchmarks.engine_systems import drive, greedy_params, timing_summary
from benchmarks.stats import LATENCY_COLUMNS, markdown_table, write_report

log = logging.getLogger(__name__)


@dataclass
class TPBenchOptions:
    out_dir: Path
    tensor_parallel: int = 2
    num_requests: int = 64
    quick: bool = False  # a smoke run with tiny numbers; its figures mean nothing
    device: str = "cpu"
    model_dir: Path | None = None  # None = the random bench model (~32M, 8/4 heads)
    seed: int = 0


def _engine(spec: dict):
    from workers.engine.config import EngineConfig, SchedulerConfig
    from workers.engine.llm_engine import LLMEngine

    work = spec["workload"]
    need = sum(len(p) + n for p, n in work)
    config = EngineConfig(
        device=spec["device"],
        threads=spec.get("threads"),
        num_kv_blocks=need // 16 + 64,
        decode_workspace_gib=64.0,
        scheduler=SchedulerConfig(max_num_seqs=len(work), max_num_batched_tokens=2048),
    )
    if spec["tensor_parallel"] == 1:
        return LLMEngine.from_pretrained(spec["ckpt"], config), None
    from workers.tp.config import ShardConfig
    from workers.tp.launch import sharded_engine

    return sharded_engine(
        Path(spec["ckpt"]), config, ShardConfig(tensor_parallel=spec["tensor_parallel"])
    )


def run_one(spec: dict) -> dict:
    """Throughput over the workload (all requests at once), then batch-1 decode steps."""
    engine, launcher = _engine(spec)
    try:
        work = spec["workload"]
        engine.generate([work[0][0][:32]], greedy_params(4))  # warm-up
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(work):
            engine.add_request(f"r{i}", prompt_token_ids=prompt, params=greedy_params(n))
        times: dict[str, list[float]] = {}
        drive(engine, times)
        timing = timing_summary(t0, times, time.perf_counter() - t0)
        # One sequence decoding alone: the per-step cost with the least compute to hide it.
        steps = spec["single_steps"]
        engine.add_request("one", prompt_token_ids=work[0][0][:64], params=greedy_params(steps + 1))
        engine.step()  # prefill
        s0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        single_ms = (time.perf_counter() - s0) / steps * 1e3
        while engine.has_unfinished_requests():
            engine.step()
        return {
            "tensor_parallel": spec["tensor_parallel"],
            "threads_per_rank": engine.runner.num_threads,
            "kv_tokens": engine.runner.kv_capacity_tokens,
            "kv_gib_per_rank": sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches) / 2**30,
            "single_decode_step_ms": single_ms,
            **timing,
        }
    finally:
        if launcher is not None:
            launcher.close()


def _run_child(spec: dict, tmp: Path) -> dict:
    name = f"tp{spec['tensor_parallel']}-t{spec.get('threads')}"
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "benchmarks.engine_tp", str(spec_path), str(out_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        log.error("tensor_parallel=%s failed:\n%s", spec["tensor_parallel"], proc.stderr[-3000:])
        lines = proc.stderr.strip().splitlines()
        return {"tensor_parallel": spec["tensor_parallel"], "error": lines[-1] if lines else "?"}
    return json.loads(out_path.read_text())


def run_tp_bench(opts: TPBenchOptions) -> dict:
    if opts.model_dir is not None:
        ckpt = opts.model_dir
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    else:
        ckpt = make_bench_checkpoint(opts.out_dir / "bench-model")
        vocab = 8192
    work = make_workload(opts.num_requests, opts.seed, opts.quick, vocab)
    base = {
        "ckpt": str(ckpt),
        "workload": work,
        "device": opts.device,
        "single_steps": 8 if opts.quick else 32,
    }
    n = opts.tensor_parallel
    # One rank with every core; one rank with one rank's share of them; N ranks.
    share = max(_cpus() // n, 1) if opts.device == "cpu" else None
    runs = [(1, None), (1, share), (n, None)] if n != 1 else [(1, None)]
    if share is None or share == _cpus():
        runs = [r for i, r in enumerate(runs) if i != 1]
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for size, threads in runs:
            print(
                f"bench engine: tensor_parallel={size}, threads={threads or 'default'} ...",
                file=sys.stderr,
                flush=True,
            )
            spec = {**base, "tensor_parallel": size, "threads": threads}
            results.append(_run_child(spec, Path(tmp)))
    data = {
        "options": {
            "tensor_parallel": opts.tensor_parallel,
            "num_requests": opts.num_requests,
            "quick": opts.quick,
            "device": opts.device,
            "model": str(opts.model_dir) if opts.model_dir else "random bench model (~32M)",
            "machine": f"{platform.machine()}, {_cpus()} CPUs",
            "load_average_1m": round(os.getloadavg()[0], 2),
        },
        "results": results,
    }
    markdown = summarize(data)
    json_path, md_path = write_report(opts.out_dir, "engine-tp", data, markdown)
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")
    return data


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def summarize(data: dict) -> str:
    opts, results = data["options"], data["results"]
    parts = ["**Quick smoke run: these figures are not the benchmark.**\n"] if opts["quick"] else []
    parts.append(
        f"Model: {opts['model']}, fp32, {opts['device']} ({opts['machine']}); "
        f"{opts['num_requests']} requests, all at once; load average "
        f"{opts['load_average_1m']} when it ended (other work on the machine skews CPU "
        "figures).\n"
    )
    cols = [
        ("tensor_parallel", "ranks"),
        ("threads_per_rank", "threads/rank"),
        *LATENCY_COLUMNS,
        ("single_decode_step_ms", "batch-1 step ms"),
        ("kv_tokens", "KV tokens"),
        ("kv_gib_per_rank", "KV GiB/rank"),
    ]
    parts.append(markdown_table([r for r in results if "error" not in r], cols))
    ok = [r for r in results if "error" not in r]
    n = opts["tensor_parallel"]
    if opts["device"] == "cpu" and n != 1 and len(ok) == len(results):
        one, many = ok[0], ok[-1]
        same = ok[1] if len(ok) == 3 else one  # one rank on one rank's share of the cores
        parts.append(
            f"\nOn a CPU the {n} ranks share the cores one rank had to itself, so this "
            "measures what sharding costs, not a speed-up. Throughput: "
            f"{many['tokens_per_s'] / one['tokens_per_s']:.2f}x one rank with every core, "
            f"{many['tokens_per_s'] / same['tokens_per_s']:.2f}x one rank with "
            f"{same['threads_per_rank']} thread(s). A batch-1 decode step costs "
            f"{many['single_decode_step_ms'] - same['single_decode_step_ms']:+.1f} ms against "
            "the latter: the step message, two all-reduces per layer and the logits gather, "
            "over gloo on loopback. Each rank holds 1/N of the weights and of the KV bytes per "
            "token, so the same KV budget per device holds N times the tokens."
        )
    errors = {r["tensor_parallel"]: r["error"] for r in results if "error" in r}
    if errors:
        parts.append("\nFailed: " + json.dumps(errors))
    return "\n".join(parts)


def main() -> None:
    logging.basicConfig(level="WARNING")
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = run_one(spec)
    Path(sys.argv[2]).write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # the shard group's threads are gone; do not wait on gloo at exit


if __name__ == "__main__":
    main()
