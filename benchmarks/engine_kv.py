"""`switchyard bench engine --scenarios kv-int8`: the engine with an int8 KV cache beside the
same engine without it (bf16 KV), bf16 weights, the real default model, in one run.

Both engines live in one process (a child of the command), so that what else runs on the
machine weighs on both alike: the speed runs alternate between them, c by c, the order
flipped every round, and each row of the report is a mode's best round. Per mode: the KV
tokens the same `kv_cache_gib` holds; the largest batch of 4,096-token contexts that fits,
as planned and as run (one more request than the plan is submitted with it: the batch must
run with no preemption while the extra one waits); output tok/s, TTFT and ITL with c = 1,
8 and 32 requests at once (512-token prompts, 128 greedy tokens each); and the perplexity
of a held text (`held_text.py`), teacher-forced: position i is a request for the text's
first i tokens whose next token is forced by `logit_bias` (logprobs are the raw
distribution's), its context served from the prefix cache, so every position reads the
cached KV back.

`python -m benchmarks.engine_kv SPEC_JSON OUT_JSON` runs the measurements.
"""

import json
import logging
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from benchmarks.engine_systems import drive, greedy_params, timing_summary
from benchmarks.held_text import HELD_TEXT
from benchmarks.stats import markdown_table, write_report

log = logging.getLogger(__name__)

MODES = ("auto", "int8")
CONTEXT = 4096  # the context whose largest batch is measured
TARGET_RATIO = 1.9  # int8 KV holds >= 1.9x the tokens of bf16 KV in the same bytes


@dataclass
class KVBenchOptions:
    out_dir: Path
    model_dir: Path
    quick: bool = False  # a smoke run with tiny numbers; its figures mean nothing
    kv_cache_gib: float = 0.375  # configs/serve.yaml's pools
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    prompt_tokens: int = 512
    output_tokens: int = 128
    rounds: int = 3
    seed: int = 0


def run_kv_bench(opts: KVBenchOptions) -> dict:
    quick = opts.quick
    spec = {
        "ckpt": str(opts.model_dir),
        "kv_cache_gib": opts.kv_cache_gib,
        "concurrency": [1, 4] if quick else opts.concurrency,
        "prompt_tokens": 64 if quick else opts.prompt_tokens,
        "output_tokens": 16 if quick else opts.output_tokens,
        "rounds": 1 if quick else opts.rounds,
        "fit_run": not quick,
        "held_tokens": 160 if quick else None,
        "seed": opts.seed,
    }
    with tempfile.TemporaryDirectory() as tmp:
        results = _run_child(spec, Path(tmp))
    data = {
        "options": {
            "model": str(opts.model_dir),
            "quick": quick,
            "machine": platform.processor() or platform.machine(),
            "cpus": len(os.sched_getaffinity(0)),
            "load_average_1m": round(os.getloadavg()[0], 2),
            **{k: v for k, v in spec.items() if k != "ckpt"},
        },
        "results": results,
    }
    data["summary"] = summarize(results)
    markdown = report(data)
    json_path, md_path = write_report(opts.out_dir, "engine-kv-int8", data, markdown)
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")
    return data


def _run_child(spec: dict, tmp: Path) -> dict:
    """The measurements, in a process of their own; its stderr (the progress) passes through."""
    spec_path, out_path = tmp / "spec.json", tmp / "out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "benchmarks.engine_kv", str(spec_path), str(out_path)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        return {"error": f"the measuring process exited {proc.returncode} (its log above)"}
    return json.loads(out_path.read_text())


# -- the measurements, in their own process -----------------------------------------------


def _engine(spec: dict, kv_cache_dtype: str):
    from workers.engine.config import EngineConfig, SchedulerConfig
    from workers.engine.llm_engine import LLMEngine

    config = EngineConfig(
        dtype="bfloat16",
        kv_cache_gib=spec["kv_cache_gib"],
        kv_cache_dtype=kv_cache_dtype,
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
    )
    return LLMEngine.from_pretrained(spec["ckpt"], config)


def _capacity(engine) -> dict:
    runner = engine.runner
    return {
        "kv_tokens": runner.kv_capacity_tokens,
        "kv_bytes_per_token": runner.kv_bytes_per_token,
        "kv_gib": sum(k.nbytes + v.nbytes for k, v in runner.kv_caches) / 2**30,
        "batch_at_4096": runner.num_kv_blocks // -(-CONTEXT // runner.block_size),
        "workspace_rows": runner.workspace.max_rows if runner.workspace else 0,
    }


def run_all(spec: dict) -> dict:
    engines = {mode: _engine(spec, mode) for mode in MODES}
    out: dict = {mode: {"kv_cache_dtype": mode, **_capacity(e)} for mode, e in engines.items()}
    vocab = engines["auto"].runner.model_config.vocab_size
    rng = random.Random(spec["seed"])

    def prompt(n: int) -> list[int]:  # fresh random tokens: no prefix-cache hits
        return [rng.randrange(3, vocab) for _ in range(n)]

    for engine in engines.values():
        engine.generate([prompt(32) for _ in range(4)], greedy_params(8))  # warm-up
    n_prompt, n_out = spec["prompt_tokens"], spec["output_tokens"]
    runs = [
        (r, c, mode)
        for r in range(spec["rounds"])
        for c in spec["concurrency"]
        for mode in (MODES if r % 2 == 0 else MODES[::-1])
    ]
    for r, c, mode in tqdm(runs, desc="kv-int8 speed", unit="run"):
        engine = engines[mode]
        times: dict[str, list[float]] = {}
        for p in [prompt(n_prompt) for _ in range(c)]:
            engine.add_request(prompt_token_ids=p, params=greedy_params(n_out))
        t0 = time.perf_counter()
        drive(engine, times)
        point = timing_summary(t0, times, time.perf_counter() - t0)
        out[mode].setdefault(f"c{c}", []).append({"round": r, **point})
    for mode, engine in tqdm(engines.items(), desc="kv-int8 capacity, perplexity", unit="mode"):
        if spec["fit_run"]:
            out[mode]["fit"] = _fit(engine, out[mode]["batch_at_4096"], prompt)
        out[mode]["perplexity"] = _perplexity(engine, spec.get("held_tokens"))
    return out


def _fit(engine, batch: int, prompt) -> dict:
    """`batch` + 1 requests of 4,096 tokens (prompt and 32 generated) at once: how many ran
    together at most, and how often the scheduler preempted."""
    n_out = 32
    for _ in range(batch + 1):
        engine.add_request(prompt_token_ids=prompt(CONTEXT - n_out), params=greedy_params(n_out))
    preempted = engine.scheduler.num_preemptions
    peak = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return {
        "requests": batch + 1,
        "peak_running": peak,
        "preemptions": engine.scheduler.num_preemptions - preempted,
        "elapsed_s": time.perf_counter() - t0,
    }


def _perplexity(engine, limit: int | None) -> dict:
    """exp(-mean log p(token i | tokens < i)) over the held text (teacher-forced, see the
    module's docstring)."""
    from workers.engine.sampling_params import SamplingParams

    assert engine.tokenizer is not None, "the held text needs the model's tokenizer"
    ids = engine.tokenizer.encode(HELD_TEXT, True)[:limit]
    engine.generate([ids[:-1]], greedy_params(1))  # its blocks into the prefix cache
    reqs = {}
    for i in range(1, len(ids)):
        params = SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=0, logit_bias={ids[i]: 100.0}
        )
        reqs[engine.add_request(prompt_token_ids=ids[:i], params=params).request_id] = ids[i]
    logprobs: list[float] = []
    cached = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.logprobs:
                assert o.new_token_ids == [reqs[o.request_id]], "the forced token was not taken"
                logprobs.append(o.logprobs[0].logprob)
                cached += o.num_cached_tokens
    return {
        "tokens": len(logprobs),
        "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
        "mean_logprob": sum(logprobs) / len(logprobs),
        "context_tokens_from_cache": cached / max(sum(range(1, len(ids))), 1),
    }


# -- the report ---------------------------------------------------------------------------


def _best(points: list[dict]) -> dict:
    """A mode's best round at one c (the highest tok/s: the least disturbed by other work),
    with every round's tok/s beside it."""
    best = max(points, key=lambda p: p["tokens_per_s"])
    return {**best, "rounds_tokens_per_s": [round(p["tokens_per_s"], 1) for p in points]}


def summarize(results: dict) -> dict:
    if "error" in results:
        return {}
    bf16, int8 = results["auto"], results["int8"]
    ratio = int8["kv_tokens"] / bf16["kv_tokens"]
    return {
        "kv_tokens_ratio": ratio,
        "target_met": ratio >= TARGET_RATIO,
        "batch_at_4096": {m: results[m]["batch_at_4096"] for m in MODES},
        "perplexity": {m: results[m]["perplexity"]["perplexity"] for m in MODES},
    }


def report(data: dict) -> str:
    opts, results, summary = data["options"], data["results"], data["summary"]
    parts = ["**Quick smoke run: these figures are not the benchmark.**\n"] if opts["quick"] else []
    parts.append(
        f"Model: {opts['model']}, bf16 weights, {opts['cpus']} CPUs ({opts['machine']}); "
        f"kv_cache_gib {opts['kv_cache_gib']} in both modes; both engines in one process, "
        f"speed runs alternating between them, {opts['rounds']} round(s), each row its "
        f"mode's best; load average {opts['load_average_1m']} when it ended (other work on "
        "the machine skews CPU figures).\n"
    )
    if "error" in results:
        parts.append(f"Failed: {results['error']}")
        return "\n".join(parts)
    label = {"auto": "bf16 KV", "int8": "int8 KV"}
    rows = []
    for m in MODES:
        r = results[m]
        fit = r.get("fit")
        ran = "not run"
        if fit:
            ran = f"{fit['peak_running']} of {fit['requests']}, {fit['preemptions']} preempted"
        rows.append(
            {
                "mode": label[m],
                "bytes": r["kv_bytes_per_token"],
                "tokens": r["kv_tokens"],
                "gib": r["kv_gib"],
                "batch": r["batch_at_4096"],
                "ran": ran,
                "rows": r["workspace_rows"],
                "ppl": r["perplexity"]["perplexity"],
            }
        )
    ppl = summary["perplexity"]
    parts += [
        "## Capacity and quality\n",
        markdown_table(
            rows,
            [
                ("mode", "KV cache"),
                ("bytes", "bytes/token"),
                ("tokens", "KV tokens"),
                ("gib", "KV GiB"),
                ("batch", f"batch at {CONTEXT:,} tokens (planned)"),
                ("ran", "ran at once"),
                ("rows", "workspace rows"),
                ("ppl", "held-text perplexity"),
            ],
        ),
        f"\nint8 KV holds **{summary['kv_tokens_ratio']:.2f}x** the tokens of bf16 KV in the "
        f"same bytes (target >= {TARGET_RATIO}x: "
        f"{'met' if summary['target_met'] else 'NOT met'}); perplexity {ppl['auto']:.3f} -> "
        f"{ppl['int8']:.3f} ({ppl['int8'] / ppl['auto'] - 1:+.2%}) over "
        f"{results['int8']['perplexity']['tokens']} teacher-forced tokens.\n",
    ]
    speed = []
    for c in opts["concurrency"]:
        for m in MODES:
            speed.append({"c": c, "mode": label[m], **_best(results[m][f"c{c}"])})
    parts += [
        f"## Speed: c requests at once, {opts['prompt_tokens']}-token prompts, "
        f"{opts['output_tokens']} tokens each\n",
        markdown_table(
            speed,
            [
                ("c", "c"),
                ("mode", "KV cache"),
                ("tokens_per_s", "output tok/s"),
                ("rounds_tokens_per_s", "tok/s of each round"),
                ("ttft_p50_ms", "TTFT p50 ms"),
                ("itl_p50_ms", "ITL p50 ms"),
                ("itl_p99_ms", "ITL p99 ms"),
            ],
        ),
    ]
    return "\n".join(parts)


def main() -> None:
    logging.basicConfig(level="WARNING")
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run_all(spec)))


if __name__ == "__main__":
    main()
