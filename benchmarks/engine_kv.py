"""`switchyard bench engine --scenarios kv-int8`: the engine with an int8 KV cache beside the
same engine without it (bf16 KV), bf16 weights, the real default model, in one run.

Per mode, in a process of its own (alternating, `rounds` of each): the KV tokens the same
`kv_cache_gib` holds; the largest batch of 4,096-token contexts that fits, as planned and
as run (one more request than the plan is submitted with it: the batch must run with no
preemption while the extra one waits); output tok/s, TTFT and ITL with c = 1, 8 and 32
requests at once (512-token prompts, 128 greedy tokens each); and the perplexity of a held
text (`held_text.py`), teacher-forced: position i is a request for the text's first i
tokens whose next token is forced by `logit_bias` (logprobs are the raw distribution's),
its context served from the prefix cache, so every position reads the cached KV back.

`python -m benchmarks.engine_kv SPEC_JSON OUT_JSON` runs one mode.
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
    rounds: int = 2
    seed: int = 0


def run_kv_bench(opts: KVBenchOptions) -> dict:
    quick = opts.quick
    base = {
        "ckpt": str(opts.model_dir),
        "kv_cache_gib": opts.kv_cache_gib,
        "concurrency": [1, 4] if quick else opts.concurrency,
        "prompt_tokens": 64 if quick else opts.prompt_tokens,
        "output_tokens": 16 if quick else opts.output_tokens,
        "fit_run": not quick,
        "held_tokens": 160 if quick else None,
        "seed": opts.seed,
    }
    rounds = 1 if quick else opts.rounds
    jobs = [(mode, r) for r in range(rounds) for mode in MODES]
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, r in tqdm(jobs, desc="bench engine kv-int8", unit="run"):
            # Capacity and perplexity do not change from round to round: the first measures them.
            first = r == 0
            spec = {**base, "kv_cache_dtype": mode, "fit_run": base["fit_run"] and first}
            spec["perplexity"] = first
            results[mode].append(_run_child(spec, Path(tmp), f"{mode}-{r}"))
    data = {
        "options": {
            "model": str(opts.model_dir),
            "quick": quick,
            "rounds": rounds,
            "machine": platform.processor() or platform.machine(),
            "cpus": len(os.sched_getaffinity(0)),
            "load_average_1m": round(os.getloadavg()[0], 2),
            **{k: v for k, v in base.items() if k != "ckpt"},
        },
        "results": results,
    }
    data["summary"] = summarize(results)
    markdown = report(data)
    json_path, md_path = write_report(opts.out_dir, "engine-kv-int8", data, markdown)
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")
    return data


def _run_child(spec: dict, tmp: Path, name: str) -> dict:
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "benchmarks.engine_kv", str(spec_path), str(out_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        log.error("%s failed:\n%s", name, proc.stderr[-3000:])
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(out_path.read_text())


# -- one mode, in its own process ---------------------------------------------------------


def _engine(spec: dict):
    from workers.engine.config import EngineConfig, SchedulerConfig
    from workers.engine.llm_engine import LLMEngine

    config = EngineConfig(
        dtype="bfloat16",
        kv_cache_gib=spec["kv_cache_gib"],
        kv_cache_dtype=spec["kv_cache_dtype"],
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
    )
    return LLMEngine.from_pretrained(spec["ckpt"], config)


def run_one(spec: dict) -> dict:
    engine = _engine(spec)
    runner = engine.runner
    rng = random.Random(spec["seed"])
    vocab = runner.model_config.vocab_size

    def prompt(n: int) -> list[int]:  # fresh random tokens: no prefix-cache hits
        return [rng.randrange(3, vocab) for _ in range(n)]

    per_seq = -(-CONTEXT // runner.block_size)
    out: dict = {
        "kv_cache_dtype": spec["kv_cache_dtype"],
        "kv_tokens": runner.kv_capacity_tokens,
        "kv_bytes_per_token": runner.kv_bytes_per_token,
        "kv_gib": sum(k.nbytes + v.nbytes for k, v in runner.kv_caches) / 2**30,
        "batch_at_4096": runner.num_kv_blocks // per_seq,
        "workspace_rows": runner.workspace.max_rows if runner.workspace else 0,
    }
    engine.generate([prompt(32) for _ in range(4)], greedy_params(8))  # warm-up
    n_prompt, n_out = spec["prompt_tokens"], spec["output_tokens"]
    for c in spec["concurrency"]:
        times: dict[str, list[float]] = {}
        for p in [prompt(n_prompt) for _ in range(c)]:
            engine.add_request(prompt_token_ids=p, params=greedy_params(n_out))
        t0 = time.perf_counter()
        drive(engine, times)
        out[f"c{c}"] = timing_summary(t0, times, time.perf_counter() - t0)
    if spec["fit_run"]:
        out["fit"] = _fit(engine, out["batch_at_4096"], prompt)
    if spec["perplexity"]:
        out["perplexity"] = _perplexity(engine, spec.get("held_tokens"))
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


def _best(rounds: list[dict], key: str) -> dict:
    """The round with the highest tok/s at `key` (the least disturbed by other work)."""
    ok = [r for r in rounds if key in r]
    return max(ok, key=lambda r: r[key]["tokens_per_s"])[key] if ok else {}


def summarize(results: dict[str, list[dict]]) -> dict:
    first = {m: next((r for r in rs if "error" not in r), {}) for m, rs in results.items()}
    bf16, int8 = first["auto"], first["int8"]
    if not bf16 or not int8:
        return {}
    ratio = int8["kv_tokens"] / bf16["kv_tokens"]
    return {
        "kv_tokens_ratio": ratio,
        "target_met": ratio >= TARGET_RATIO,
        "batch_at_4096": {"auto": bf16["batch_at_4096"], "int8": int8["batch_at_4096"]},
        "perplexity": {m: first[m]["perplexity"]["perplexity"] for m in MODES},
    }


def report(data: dict) -> str:
    opts, results, summary = data["options"], data["results"], data["summary"]
    parts = ["**Quick smoke run: these figures are not the benchmark.**\n"] if opts["quick"] else []
    parts.append(
        f"Model: {opts['model']}, bf16 weights, {opts['cpus']} CPUs ({opts['machine']}); "
        f"kv_cache_gib {opts['kv_cache_gib']} in both modes; each mode in its own process, "
        f"{opts['rounds']} round(s) alternating, speed rows the best round; load average "
        f"{opts['load_average_1m']} when it ended (other work on the machine skews CPU "
        "figures).\n"
    )
    first = {m: next((r for r in rs if "error" not in r), None) for m, rs in results.items()}
    if first["auto"] is None or first["int8"] is None:
        parts.append(
            "Failed: " + json.dumps({m: [r.get("error") for r in rs] for m, rs in results.items()})
        )
        return "\n".join(parts)
    label = {"auto": "bf16 KV", "int8": "int8 KV"}
    rows = []
    for m in MODES:
        r = first[m]
        fit = r.get("fit", {})
        rows.append(
            {
                "mode": label[m],
                "bytes": r["kv_bytes_per_token"],
                "tokens": r["kv_tokens"],
                "gib": r["kv_gib"],
                "batch": r["batch_at_4096"],
                "ran": f"{fit['peak_running']} of {fit['requests']}, {fit['preemptions']} preempted"
                if fit
                else "not run",
                "rows": r["workspace_rows"],
                "ppl": r["perplexity"]["perplexity"],
            }
        )
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
        f"same bytes (target >= {TARGET_RATIO}x: {'met' if summary['target_met'] else 'NOT met'}); "
        f"perplexity {summary['perplexity']['auto']:.3f} -> {summary['perplexity']['int8']:.3f} "
        f"({summary['perplexity']['int8'] / summary['perplexity']['auto'] - 1:+.2%}) over "
        f"{first['int8']['perplexity']['tokens']} teacher-forced tokens.\n",
    ]
    speed = []
    for c in opts["concurrency"]:
        for m in MODES:
            speed.append({"c": c, "mode": label[m], **_best(results[m], f"c{c}")})
    parts += [
        f"## Speed: c requests at once, {opts['prompt_tokens']}-token prompts, "
        f"{opts['output_tokens']} tokens each\n",
        markdown_table(
            speed,
            [
                ("c", "c"),
                ("mode", "KV cache"),
                ("tokens_per_s", "output tok/s"),
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
    Path(sys.argv[2]).write_text(json.dumps(run_one(spec)))


if __name__ == "__main__":
    main()
