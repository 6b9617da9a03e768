"""The systems and scenarios of `switchyard bench engine`, each run in its own process.

`python -m benchmarks.engine_systems SYSTEM SPEC_JSON OUT_JSON` runs one of them, so
each gets a clean process (its own peak memory) and they never share threads.
"""

import gc
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_levers import run_levers
from benchmarks.engine_spec import run_speculative
from benchmarks.engine_structured import run_structured
from benchmarks.roofline import (
    Machine,
    ModelShape,
    Reading,
    StepCost,
    bandwidth_rates,
    gemm_rates,
    roofline_s,
    serial_s,
    step_cost,
)
from benchmarks.stats import latency_summary, percentile

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# A decode workspace row for every sequence, whatever the model: the bench measures the
# design (a worker's default 0.25 GiB holds 16 rows of the bench model in fp32).
WORKSPACE_GIB = 64.0


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _engine(ckpt: str, *, num_blocks: int, budget: int, max_seqs: int, **kw: Any):
    # The previous round's engine is garbage (reference cycles): collect it now, not as
    # a pause of 30-50 ms in the middle of this engine's timed steps.
    gc.collect()
    from workers.engine.config import EngineConfig, SchedulerConfig
    from workers.engine.llm_engine import LLMEngine

    prefix = kw.pop("enable_prefix_caching", True)
    dtype = kw.pop("dtype", "float32")
    sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, **kw)
    cfg = EngineConfig(
        num_kv_blocks=num_blocks,
        scheduler=sched,
        enable_prefix_caching=prefix,
        decode_workspace_gib=WORKSPACE_GIB,
        dtype=dtype,
    )
    return LLMEngine.from_pretrained(ckpt, cfg)


def greedy_params(max_tokens: int):
    from workers.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def drive(engine, times: dict[str, list[float]]) -> None:
    """Step until idle, stamping each new token with the wall time of its step."""
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                times.setdefault(o.request_id, []).append(now)


def timing_summary(t0: float, times: dict[str, list[float]], elapsed: float) -> dict[str, float]:
    ttft = [ts[0] - t0 for ts in times.values()]
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:], strict=False)]
    n = sum(len(ts) for ts in times.values())
    return {
        "output_tokens": n,
        "elapsed_s": elapsed,
        "tokens_per_s": n / elapsed,
        **latency_summary(ttft, itl),
    }


class CostMeter:
    """Records the bytes and FLOPs of every step the engine's runner executes, what kind
    of step it was (`step_kind`) and how long the runner took over it."""

    def __init__(self, engine) -> None:
        self.shape = ModelShape.of(engine.runner.model_config)
        self.itemsize = engine.runner.dtype.itemsize
        self.steps: list[StepCost] = []
        self.kinds: list[str] = []
        self.seconds: list[float] = []
        runner = engine.runner
        execute = runner.execute

        def metered(scheduled, block_tables):
            self.steps.append(self.cost(scheduled))
            self.kinds.append(step_kind(scheduled))
            t0 = time.perf_counter()
            out = execute(scheduled, block_tables)
            self.seconds.append(time.perf_counter() - t0)
            return out

        runner.execute = metered

    def by_kind(self, machine: Machine) -> list[dict[str, Any]]:
        """Per kind of step (in `STEP_KINDS` order): steps, the runner's seconds, and the
        no-overlap bound and roofline of those steps."""
        rows = {k: {"kind": k, "steps": 0, "measured_s": 0.0, "serial_s": 0.0, "roofline_s": 0.0}
                for k in STEP_KINDS}  # fmt: skip
        for kind, cost, secs in zip(self.kinds, self.steps, self.seconds, strict=True):
            row = rows[kind]
            row["steps"] += 1
            row["measured_s"] += secs
            row["serial_s"] += serial_s(cost, machine)
            row["roofline_s"] += roofline_s(cost, machine)
        return [row for row in rows.values() if row["steps"]]

    def cost(self, scheduled) -> StepCost:
        decodes = [r.num_computed_tokens for r, n in scheduled if n == 1]
        prefills = [(r.num_computed_tokens, n) for r, n in scheduled if n > 1]
        sampled = sum(1 for r, n in scheduled if r.num_computed_tokens + n == r.num_tokens)
        return step_cost(self.shape, self.itemsize, decodes, prefills, sampled)


STEP_KINDS = (
    "with a prompt chunk",
    "decodes, batch >= 48",
    "decodes, batch 16-47",
    "decodes, batch < 16",
)


def step_kind(scheduled) -> str:
    """A step with any prompt chunk, else its decodes' batch size band (`STEP_KINDS`)."""
    if any(n > 1 for _, n in scheduled):
        return STEP_KINDS[0]
    batch = len(scheduled)
    return STEP_KINDS[1] if batch >= 48 else STEP_KINDS[2] if batch >= 16 else STEP_KINDS[3]


def measure_machine(dtype: str, earlier: Reading | None = None) -> Reading:
    """GEMM peak and bandwidth now, or the best of now and `earlier`: on a shared machine a
    single measurement taken while busy would make the roofline too lenient."""
    return Reading(gemm_rates(DTYPES[dtype]), bandwidth_rates()).best_with(earlier)


def run_switchyard(spec: dict) -> dict:
    work = spec["workload"]
    need = sum(len(p) + n for p, n in work)
    dtype = spec.get("dtype", "float32")
    engine = _engine(
        spec["ckpt"],
        num_blocks=need // 16 + 64,
        budget=spec["budget"],
        max_seqs=len(work),
        dtype=dtype,
    )
    engine.generate([work[0][0][:32]], greedy_params(4))  # warm-up
    before = measure_machine(dtype)
    meter = CostMeter(engine)
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(work):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=greedy_params(n))
    times: dict[str, list[float]] = {}
    drive(engine, times)
    out = timing_summary(t0, times, time.perf_counter() - t0)
    out["num_preemptions"] = engine.scheduler.num_preemptions
    reading = measure_machine(dtype, before)
    machine = reading.machine
    roof = sum(roofline_s(c, machine) for c in meter.steps)
    serial = sum(serial_s(c, machine) for c in meter.steps)
    out.update(
        machine=reading.as_dict(),
        num_steps=len(meter.steps),
        roofline_s=roof,
        over_roofline=out["elapsed_s"] / roof,
        serial_s=serial,
        over_serial=out["elapsed_s"] / serial,
        bytes_moved=sum(c.bytes for c in meter.steps),
        flops=sum(c.flops for c in meter.steps),
        by_kind=meter.by_kind(machine),
        outside_runner_s=out["elapsed_s"] - sum(meter.seconds),
    )
    return out


class _Stamps:
    """A transformers streamer that only records when each token arrived."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_model(ckpt: str, dtype: str = "float32", attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=DTYPES[dtype], attn_implementation=attn
    ).eval()


def run_hf_generate(spec: dict) -> dict:
    model = _hf_model(spec["ckpt"], spec.get("dtype", "float32"))
    sample = spec["workload"][: spec["hf_sample"]]
    kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.inference_mode():
        model.generate(torch.tensor([sample[0][0][:32]]), max_new_tokens=4, **kw)
        ttft, itl, total_tokens, total_s = [], [], 0, 0.0
        for prompt, n in sample:
            stamps = _Stamps()
            t0 = time.perf_counter()
            model.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, streamer=stamps, **kw
            )
            total_s += time.perf_counter() - t0
            total_tokens += len(stamps.times)
            ttft.append(stamps.times[0] - t0)
            itl += [b - a for a, b in zip(stamps.times, stamps.times[1:], strict=False)]
    return {
        "output_tokens": total_tokens,
        "elapsed_s": total_s,
        "tokens_per_s": total_tokens / total_s,
        "requests_timed": len(sample),
        **latency_summary(ttft, itl),
    }


def run_hf_generate_batch(spec: dict) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    model = _hf_model(spec["ckpt"], spec.get("dtype", "float32"))
    work = spec["workload"]
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in work), eos_token_id=-1)
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p, _ in work),
        max_generated_length=max(n for _, n in work),
        num_requests=len(work),
    )
    model.generate_batch([work[0][0][:32]], generation_config=gen, max_new_tokens=4)  # warm-up
    cm = model.continuous_batching_context_manager(
        generation_config=gen, block=True, timeout=5, workload_hints=hints
    )
    results = {}
    with cm as manager:
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(work):
            manager.add_request(
                prompt,
                request_id=f"r{i}",
                max_new_tokens=n,
                record_timestamps=True,
                eos_token_id=-1,
            )
        while len(results) < len(work):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
        elapsed = time.perf_counter() - t0
    times = {rid: list(r.timestamps or []) for rid, r in results.items()}
    errors = [r.error for r in results.values() if r.error]
    out = timing_summary(t0, times, elapsed)
    out["errors"] = errors[:3]
    out["output_tokens"] = sum(len(r.generated_tokens) for r in results.values())
    out["tokens_per_s"] = out["output_tokens"] / elapsed
    return out


def decoding_engine(ckpt: str, dtype: str, batch: int, ctx: int, steps: int):
    """An engine with `batch` random prompts of `ctx` tokens prefilled and every one of
    them decoding, with room for `steps` more decode steps."""
    engine = _engine(
        ckpt,
        num_blocks=batch * (ctx + steps + 8) // 16 + 64,
        budget=4096,
        max_seqs=batch,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(7)
    vocab = engine.runner.model_config.vocab_size
    for i in range(batch):
        prompt = torch.randint(3, vocab, (ctx,), generator=gen).tolist()
        engine.add_request(f"d{i}", prompt_token_ids=prompt, params=greedy_params(steps + 4))
    while engine.scheduler.num_running < batch or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()
    return engine


def _decode_point(spec: dict, batch: int) -> dict:
    """Decode steps at `batch` sequences of ~`decode_context` tokens: their times and costs
    (`_against` turns them into figures once the machine's best is known)."""
    steps = spec["decode_steps"]
    engine = decoding_engine(spec["ckpt"], spec["dtype"], batch, spec["decode_context"], steps)
    engine.step()  # warm
    meter = CostMeter(engine)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return {"batch": batch, "times": times, "costs": meter.steps}


def _against(point: dict, machine: Machine) -> dict:
    """A decode point's median step against its roofline on `machine`."""
    times, costs = point.pop("times"), point.pop("costs")
    ratios = sorted(t / roofline_s(c, machine) for t, c in zip(times, costs, strict=True))
    mid = costs[len(costs) // 2]
    step = percentile(times, 50)
    return {
        **point,
        "step_ms": step * 1e3,
        "roofline_ms": roofline_s(mid, machine) * 1e3,
        "over_roofline": percentile(ratios, 50),
        "serial_ms": serial_s(mid, machine) * 1e3,
        "over_serial": step / serial_s(mid, machine),
        "gflops": mid.flops / step / 1e9,
        "gb_s": mid.bytes / step / 1e9,
    }


def _prefill_point(spec: dict) -> dict:
    """One prompt of `prefill_tokens` prefilled in one step: its best time and cost."""
    n, dtype = spec["prefill_tokens"], spec["dtype"]
    engine = _engine(
        spec["ckpt"],
        num_blocks=n // 16 + 64,
        budget=n,
        max_seqs=4,
        dtype=dtype,
        enable_prefix_caching=False,
    )
    meter = CostMeter(engine)
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, engine.runner.model_config.vocab_size, (n,), generator=gen).tolist()
    times = []
    for i in range(3):
        engine.add_request(f"p{i}", prompt_token_ids=prompt, params=greedy_params(1))
        t = time.perf_counter()
        engine.step()  # the whole prompt, and its first token
        times.append(time.perf_counter() - t)
        while engine.has_unfinished_requests():
            engine.step()
    best = min(times[1:])  # the first pays for one-time allocations
    return {"tokens": n, "best": best, "cost": meter.steps[0]}


def run_decode(spec: dict) -> dict:
    """Decode steps at several batch sizes and a long prefill, each against its roofline.

    The machine (GEMM peak, bandwidth) is measured before and after, and every ratio is
    taken against the best of each: on a shared machine, a measurement taken while busy
    would make the roofline too lenient."""
    before = measure_machine(spec["dtype"])
    points = [_decode_point(spec, b) for b in spec["decode_batches"]]
    pre = _prefill_point(spec)
    reading = measure_machine(spec["dtype"], before)
    machine = reading.machine
    cost, best = pre.pop("cost"), pre.pop("best")
    prefill = {
        **pre,
        "step_ms": best * 1e3,
        "roofline_ms": roofline_s(cost, machine) * 1e3,
        "over_roofline": best / roofline_s(cost, machine),
        "serial_ms": serial_s(cost, machine) * 1e3,
        "over_serial": best / serial_s(cost, machine),
        "gflops": cost.flops / best / 1e9,
        "fraction_of_peak": cost.flops / best / machine.gemm_flops,
    }
    return {
        "machine": reading.as_dict(),
        "decode_context": spec["decode_context"],
        "decode": [_against(p, machine) for p in points],
        "prefill": prefill,
    }


def _median_round(rounds: list[dict], key: str) -> dict:
    """The round whose `key` is the median of the rounds', with every round's `key`: one
    burst is one sample, and on a shared machine one sample is one noise draw."""
    ordered = sorted(rounds, key=lambda r: r[key])
    return {**ordered[len(ordered) // 2], f"rounds_{key}": [r[key] for r in rounds]}


def run_prefix(spec: dict) -> dict:
    """32 requests sharing a long prefix, with and without prefix caching; `rounds` times
    each on a fresh engine, the median round reported."""
    prefix, suffixes = spec["prefix"], spec["suffixes"]
    out = {}
    for caching in (True, False):
        rounds = []
        for _ in range(spec.get("rounds", 1)):
            need = (len(prefix) + 80) * (len(suffixes) + 1)
            engine = _engine(
                spec["ckpt"],
                num_blocks=need // 16 + 64,
                budget=spec["budget"],
                max_seqs=64,
                enable_prefix_caching=caching,
            )
            engine.generate([prefix + suffixes[0]], greedy_params(2))  # the prefix was seen
            computed_before = engine.num_prompt_tokens_computed
            t0 = time.perf_counter()
            for i, s in enumerate(suffixes):
                engine.add_request(
                    f"p{i}", prompt_token_ids=prefix + s, params=greedy_params(spec["max_tokens"])
                )
            times: dict[str, list[float]] = {}
            drive(engine, times)
            summary = timing_summary(t0, times, time.perf_counter() - t0)
            summary["prefill_tokens_computed"] = engine.num_prompt_tokens_computed - computed_before
            summary["prompt_tokens"] = sum(len(prefix) + len(s) for s in suffixes)
            rounds.append(summary)
        out["cached" if caching else "uncached"] = _median_round(rounds, "ttft_p50_ms")
    return out


def run_chunked(spec: dict) -> dict:
    """16 decoding streams when a long prompt arrives: their worst gap vs median gap;
    `rounds` times each on a fresh engine, the median round reported."""
    out = {}
    for name, chunked, budget in (
        ("chunked", True, spec["chunk_budget"]),
        ("unchunked", False, 4096),
    ):
        rounds = [_chunked_round(spec, chunked, budget) for _ in range(spec.get("rounds", 1))]
        out[name] = _median_round(rounds, "worst_over_median")
    return out


def _chunked_round(spec: dict, chunked: bool, budget: int) -> dict:
    engine = _engine(
        spec["ckpt"],
        num_blocks=4096,
        budget=budget,
        max_seqs=32,
        enable_chunked_prefill=chunked,
    )
    for i, p in enumerate(spec["streams"]):
        engine.add_request(f"s{i}", prompt_token_ids=p, params=greedy_params(spec["stream_tokens"]))
    times: dict[str, list[float]] = {}
    for _ in range(spec["warm_steps"]):
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            times.setdefault(o.request_id, []).append(now)
    arrival = time.perf_counter()
    engine.add_request("long", prompt_token_ids=spec["long_prompt"], params=greedy_params(4))
    drive(engine, times)
    gaps = [
        b - a
        for rid, ts in times.items()
        if rid != "long"
        for a, b in zip(ts, ts[1:], strict=False)
    ]
    window = [
        b - a
        for rid, ts in times.items()
        if rid != "long"
        for a, b in zip(ts, ts[1:], strict=False)
        if b >= arrival and a <= times["long"][0]
    ]
    med = percentile(gaps, 50)
    return {
        "median_gap_ms": med * 1e3,
        "worst_gap_ms": max(gaps) * 1e3,
        "worst_over_median": max(gaps) / med,
        "long_prompt_ttft_ms": (times["long"][0] - arrival) * 1e3,
        "gaps_while_prefilling": len(window),
        "max_num_batched_tokens": budget,
    }


def run_ttft_probe(spec: dict) -> dict:
    """Unloaded time to first token: one request at a time, in-process."""
    engine = _engine(spec["ckpt"], num_blocks=512, budget=2048, max_seqs=8)
    engine.generate([spec["prompts"][0]], greedy_params(2))  # warm-up
    ttft = []
    for i, prompt in enumerate(spec["prompts"]):
        t0 = time.perf_counter()
        engine.add_request(
            f"t{i}", prompt_token_ids=prompt, params=greedy_params(spec["max_tokens"])
        )
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and any(o.new_token_ids for o in outs):
                first = time.perf_counter() - t0
        ttft.append(first)
    return {"ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3}


SYSTEMS = {
    "ttft_probe": run_ttft_probe,
    "switchyard": run_switchyard,
    "hf_generate": run_hf_generate,
    "hf_generate_batch": run_hf_generate_batch,
    "decode": run_decode,
    "levers": run_levers,
    "prefix": run_prefix,
    "chunked": run_chunked,
    "structured": run_structured,
    "speculative": run_speculative,
}


def main() -> None:
    system, spec_path, out_path = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    result = SYSTEMS[system](spec)
    result["peak_rss_mib"] = _peak_rss_mib()
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
