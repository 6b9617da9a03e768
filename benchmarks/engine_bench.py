"""`switchyard bench engine`: the engine against transformers, same weights, same run."""

import json
import logging
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from benchmarks.engine_levers import levers_section
from benchmarks.engine_spec import speculative_section, speculative_spec
from benchmarks.engine_structured import structured_checkpoint, structured_section
from benchmarks.stats import LATENCY_COLUMNS, markdown_table, write_report

log = logging.getLogger(__name__)

# Scenarios that run the real default model unless --model (`benchmarks.engine_spec`).
SPECULATIVE = {"speculative", "speculative-workspace"}

BENCH_MODEL = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


@dataclass
class BenchOptions:
    out_dir: Path
    num_requests: int = 64
    hf_sample: int = 8
    quick: bool = False  # a smoke run with tiny numbers; its figures mean nothing
    scenarios: list[str] = field(
        default_factory=lambda: ["throughput", "decode", "prefix", "chunked"]
    )
    seed: int = 0
    model_dir: Path | None = None  # any local checkpoint; None = the random bench model
    # Throughput and decode run once per dtype, each beside transformers in that dtype.
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])


def _dtype_summary(opts: BenchOptions) -> str:
    """Which scenarios ran in which dtype, naming only those that ran."""
    per_dtype = [
        s for s in ("throughput", "decode", "levers", *sorted(SPECULATIVE)) if s in opts.scenarios
    ]
    in_fp32 = [s for s in ("prefix", "chunked", "structured") if s in opts.scenarios]
    said = []
    if per_dtype:
        said.append(f"{', '.join(per_dtype)} in {', '.join(opts.dtypes)}")
    if in_fp32:
        said.append(f"{', '.join(in_fp32)} in float32")
    return "; ".join(said) or "no scenarios"


def make_bench_checkpoint(path: Path) -> Path:
    """The bench model: Llama, hidden 512, 8 layers, 8/4 heads, vocab 8192, fp32 (~32M)."""
    if (path / "model.safetensors").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**BENCH_MODEL)).eval().save_pretrained(path)
    return path


def make_workload(
    n: int, seed: int, quick: bool, vocab: int = BENCH_MODEL["vocab_size"]
) -> list[tuple[list[int], int]]:
    """n requests: prompt lengths uniform 32-512, output lengths uniform 16-256."""
    rng = random.Random(seed)
    hi_p, hi_o = (96, 32) if quick else (512, 256)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(32, hi_p))], rng.randint(16, hi_o))
        for _ in range(n)
    ]


def _run_child(system: str, spec: dict, tmp: Path, key: str | None = None) -> dict:
    name = (key or system).replace("/", "-")
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "benchmarks.engine_systems", system, str(spec_path), str(out_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        log.error("%s failed:\n%s", system, proc.stderr[-3000:])
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(out_path.read_text())


def run_engine_bench(opts: BenchOptions) -> dict:
    if opts.model_dir is not None:
        ckpt = opts.model_dir
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    elif set(opts.scenarios) <= SPECULATIVE:  # it fetches its own: the real model
        ckpt, vocab = Path(), BENCH_MODEL["vocab_size"]
    else:
        ckpt = make_bench_checkpoint(opts.out_dir / "bench-model")
        vocab = BENCH_MODEL["vocab_size"]
    rng = random.Random(opts.seed + 1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    work = make_workload(opts.num_requests, opts.seed, opts.quick, vocab)
    jobs: list[tuple[str, dict]] = []
    for dtype in opts.dtypes:
        if "throughput" in opts.scenarios:
            base = {"ckpt": str(ckpt), "workload": work, "budget": 2048, "dtype": dtype}
            jobs += [
                (f"switchyard/{dtype}", base),
                (f"hf_generate/{dtype}", {**base, "hf_sample": opts.hf_sample}),
                (f"hf_generate_batch/{dtype}", base),
            ]
        # Decode steps at these batch sizes, each sequence ~decode_context tokens in.
        steps = {
            "ckpt": str(ckpt),
            "dtype": dtype,
            "decode_batches": [1, 16, 64],
            "decode_context": 64 if opts.quick else 256,
        }
        if "decode" in opts.scenarios:
            decode_spec = {
                **steps,
                "decode_steps": 8 if opts.quick else 24,
                "prefill_tokens": 256 if opts.quick else 2048,
            }
            jobs.append((f"decode/{dtype}", decode_spec))
        if "speculative" in opts.scenarios:
            jobs.append(
                (f"speculative/{dtype}", speculative_spec(opts.model_dir, dtype, opts.quick))
            )
        if "speculative-workspace" in opts.scenarios:
            ws_spec = speculative_spec(opts.model_dir, dtype, opts.quick, workspace=True)
            jobs.append((f"speculative-workspace/{dtype}", ws_spec))
        if "levers" in opts.scenarios:
            levers_spec = {
                **steps,
                "rounds": 2 if opts.quick else 6,
                "steps_per_round": 3 if opts.quick else 5,
            }
            jobs.append((f"levers/{dtype}", levers_spec))
    if "prefix" in opts.scenarios:
        plen = 128 if opts.quick else 1024
        jobs.append(
            (
                "prefix",
                {
                    "ckpt": str(ckpt),
                    "prefix": tokens(plen),
                    "suffixes": [tokens(rng.randint(32, 64)) for _ in range(32)],
                    "max_tokens": 8,
                    "budget": 2048,
                    "rounds": 1 if opts.quick else 3,
                },
            )
        )
    if "chunked" in opts.scenarios:
        jobs.append(
            (
                "chunked",
                {
                    "ckpt": str(ckpt),
                    "streams": [tokens(64) for _ in range(16)],
                    "stream_tokens": 400,
                    "warm_steps": 20,
                    "long_prompt": tokens(256 if opts.quick else 2048),
                    "chunk_budget": 64,
                    "rounds": 1 if opts.quick else 3,
                },
            )
        )
    if "structured" in opts.scenarios:
        structured_spec = {
            "ckpt": str(structured_checkpoint(getattr(opts, "model_dir", None), opts.out_dir)),
            "num_schemas": 8,
            "batches": [1, 64],
            "warm_steps": 3 if opts.quick else 4,
            "steps": 4 if opts.quick else 12,
            "rounds": 1 if opts.quick else 3,
        }
        jobs.append(("structured", structured_spec))
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, spec in tqdm(jobs, desc="bench engine", unit="run"):
            results[key] = _run_child(key.split("/")[0], spec, Path(tmp), key)
    report = summarize(results, opts)
    json_path, md_path = write_report(opts.out_dir, "engine", report["data"], report["markdown"])
    print(report["markdown"])
    print(f"\nwrote {json_path} and {md_path}")
    return report["data"]


def _peaks(m: dict, dtype: str) -> str:
    """The machine's GEMM peak and bandwidth, with the measurements each is the best of."""

    def by(rates: dict, unit: str) -> str:
        return ", ".join(f"{k} {v:,.1f}" for k, v in rates.items()) + f" {unit}"

    gemm, stream = by(m["gemm_gflops_by"], "GFLOP/s"), by(m["stream_gb_s_by"], "GB/s")
    return (
        f"{m['gemm_gflops']:,.0f} GFLOP/s ({dtype} GEMM 2048^3, best of {gemm}) "
        f"and {m['bandwidth_gb_s']:.1f} GB/s (best of {stream})"
    )


def _ratio(a: dict, b: dict) -> float | None:
    if a.get("tokens_per_s") and b.get("tokens_per_s"):
        return a["tokens_per_s"] / b["tokens_per_s"]
    return None


def _throughput_section(
    results: dict[str, dict], opts: BenchOptions, data: dict, dtype: str
) -> list[str]:
    sy, hg, hb = (
        results.get(f"{k}/{dtype}", {}) for k in ("switchyard", "hf_generate", "hf_generate_batch")
    )
    rows = [
        {"system": "(a) switchyard engine", **sy},
        {"system": "(b) transformers generate, one at a time", **hg},
        {"system": "(c) transformers generate_batch (sdpa)", **hb},
    ]
    cols = [
        ("system", "system"),
        *LATENCY_COLUMNS,
        ("peak_rss_mib", "peak RSS MiB"),
    ]
    speed = {"vs_generate": _ratio(sy, hg), "vs_generate_batch": _ratio(sy, hb)}
    data.setdefault("speedup", {})[dtype] = speed
    lines = [
        f"## Throughput ({dtype}): {opts.num_requests} requests, all at once\n",
        markdown_table(rows, cols),
        f"\nSpeed-up: {_x(speed['vs_generate'])} vs generate (target >= 12x), "
        f"{_x(speed['vs_generate_batch'])} vs generate_batch (target >= 6x), both in {dtype}. "
        f"(b) is timed on {hg.get('requests_timed', 0)} requests; its TTFT has no queueing.",
    ]
    if "roofline_s" in sy:
        m = sy["machine"]
        lines.append(
            f"\nRoofline: {sy['num_steps']} steps moving {sy['bytes_moved'] / 1e9:.1f} GB and "
            f"computing {sy['flops'] / 1e9:.0f} GFLOP; at the measured {_peaks(m, dtype)} "
            "they need "
            f"{sy['roofline_s']:.2f} s; measured {sy['elapsed_s']:.2f} s = "
            f"**{sy['over_roofline']:.2f}x roofline** (target <= 1.5x)."
        )
    if "serial_s" in sy:
        lines.append(
            f"Without overlap of memory traffic and arithmetic (bytes / bandwidth + FLOPs / "
            f"peak, step by step) they need {sy['serial_s']:.2f} s: measured = "
            f"{sy['over_serial']:.2f}x that bound, which is itself "
            f"{sy['serial_s'] / sy['roofline_s']:.2f}x the roofline."
        )
    if sy.get("by_kind"):
        lines += ["\nWhere the workload's time goes, by kind of step (the runner's time):\n"]
        lines.append(_by_kind_table(sy["by_kind"]))
        lines.append(
            f"\nOutside the runner (scheduling, outputs): {sy['outside_runner_s']:.2f} s of "
            f"{sy['elapsed_s']:.2f}."
        )
    return lines


def _by_kind_table(rows: list[dict]) -> str:
    rows = [
        {
            **r,
            "over_serial": r["measured_s"] / r["serial_s"],
            "over_roofline": r["measured_s"] / r["roofline_s"],
        }
        for r in rows
    ]
    cols = [
        ("kind", "steps"),
        ("steps", "count"),
        ("measured_s", "measured s"),
        ("serial_s", "no-overlap bound s"),
        ("roofline_s", "roofline s"),
        ("over_serial", "measured / no-overlap"),
        ("over_roofline", "measured / roofline"),
    ]
    return markdown_table(rows, cols)


def _decode_section(dec: dict, dtype: str) -> list[str]:
    m = dec["machine"]
    rows = [{"scenario": f"decode step, batch {p['batch']}", **p} for p in dec["decode"]]
    pre = dec["prefill"]
    rows.append({"scenario": f"prefill, {pre['tokens']} tokens", **pre})
    cols = [
        ("scenario", "scenario"),
        ("step_ms", "measured ms"),
        ("roofline_ms", "roofline ms"),
        ("over_roofline", "measured / roofline"),
        ("serial_ms", "no-overlap bound ms"),
        ("over_serial", "measured / no-overlap"),
        ("gflops", "GFLOP/s"),
    ]
    b64 = next((p for p in dec["decode"] if p["batch"] == 64), None)
    target = (
        f"decode at batch 64: {b64['over_roofline']:.2f}x roofline (target <= 1.3x); "
        if b64
        else ""
    )
    return [
        f"\n## Steps against the roofline ({dtype})\n",
        f"Measured in this run: {_peaks(m, dtype)}. "
        f"Decode context ~{dec['decode_context']} tokens; "
        "roofline = max(bytes / bandwidth, FLOPs / peak) of the step; the no-overlap bound "
        "= bytes / bandwidth + FLOPs / peak, the best for phases that take turns.\n",
        markdown_table(rows, cols),
        f"\n{target}prefill reaches {pre['fraction_of_peak']:.0%} of the GEMM peak.",
    ]


def _prefix_section(pre: dict, data: dict) -> list[str]:
    c, u = pre["cached"], pre["uncached"]
    rows = [{"mode": "prefix caching on", **c}, {"mode": "prefix caching off", **u}]
    cols = [
        ("mode", "mode"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p99_ms", "TTFT p99 ms"),
        ("prefill_tokens_computed", "prefill tokens computed"),
        ("prompt_tokens", "prompt tokens"),
    ]
    ratio = u["ttft_p50_ms"] / c["ttft_p50_ms"]
    saved = 1 - c["prefill_tokens_computed"] / max(u["prefill_tokens_computed"], 1)
    data["prefix_summary"] = {"ttft_p50_ratio": ratio, "prefill_tokens_saved": saved}
    return [
        "\n## Prefix caching: 32 requests sharing a long prefix\n",
        _rounds_line(c, u, "ttft_p50_ms", "TTFT p50 ms"),
        markdown_table(rows, cols),
        f"\nTTFT p50 {ratio:.1f}x lower with caching (target >= 8x); "
        f"{saved:.1%} fewer prefill tokens computed (target >= 90%).",
    ]


def _rounds_line(on: dict, off: dict, key: str, what: str) -> str:
    """Which round each row is, when the scenario ran several (one burst is one sample)."""
    a, b = on.get(f"rounds_{key}"), off.get(f"rounds_{key}")
    if not a or len(a) < 2:
        return ""
    fmt = ", ".join
    return (
        f"Each mode ran {len(a)} times on a fresh engine; the row is its median round "
        f"({what} of the rounds: {fmt(f'{v:.2f}' for v in a)} and {fmt(f'{v:.2f}' for v in b)}).\n"
    )


def _chunked_section(ch: dict) -> list[str]:
    rows = [{"mode": k, **v} for k, v in ch.items() if isinstance(v, dict)]
    cols = [
        ("mode", "mode"),
        ("max_num_batched_tokens", "token budget"),
        ("median_gap_ms", "median gap ms"),
        ("worst_gap_ms", "worst gap ms"),
        ("worst_over_median", "worst / median"),
        ("long_prompt_ttft_ms", "long prompt TTFT ms"),
    ]
    return [
        "\n## Chunked prefill: 16 streams decoding when a long prompt arrives\n",
        _rounds_line(ch["chunked"], ch["unchunked"], "worst_over_median", "worst / median"),
        markdown_table(rows, cols),
        "\nTarget: worst / median <= 3 with chunking; measured "
        f"{ch['chunked']['worst_over_median']:.2f}.",
    ]


def _model_label(opts: BenchOptions) -> str:
    if opts.model_dir:
        return str(opts.model_dir)
    if set(opts.scenarios) <= SPECULATIVE:
        return "the default real model"
    return "random bench model (~32M)"


def summarize(results: dict[str, dict], opts: BenchOptions) -> dict:
    data: dict = {
        "options": {
            "num_requests": opts.num_requests,
            "hf_sample": opts.hf_sample,
            "quick": opts.quick,
            "model": _model_label(opts),
            "dtypes": opts.dtypes,
        },
        "results": results,
    }
    ok = {k: v for k, v in results.items() if "error" not in v}
    parts = ["**Quick smoke run: these figures are not the benchmark.**\n"] if opts.quick else []
    parts.append(f"Model: {data['options']['model']}; {_dtype_summary(opts)}.\n")
    for dtype in opts.dtypes:
        if f"switchyard/{dtype}" in results:
            parts += _throughput_section(results, opts, data, dtype)
        if f"decode/{dtype}" in ok:
            parts += _decode_section(ok[f"decode/{dtype}"], dtype)
        if f"levers/{dtype}" in ok:
            parts += levers_section(ok[f"levers/{dtype}"])
        for key in (f"speculative/{dtype}", f"speculative-workspace/{dtype}"):
            if key in ok:
                parts += speculative_section(ok[key], dtype)
    if "prefix" in ok:
        parts += _prefix_section(ok["prefix"], data)
    if "chunked" in ok:
        parts += _chunked_section(ok["chunked"])
    if "structured" in ok:
        parts += structured_section(ok["structured"])
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    if errors:
        parts.append("\nFailed: " + json.dumps(errors))
    return {"data": data, "markdown": "\n".join(parts)}


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}x"
