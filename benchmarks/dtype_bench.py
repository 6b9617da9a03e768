"""`switchyard bench dtype`: is bfloat16 close enough to float32 on a model, and faster?

Both engines load the same checkpoint here, one after the other, in one process. Close:
each prompt's greedy continuation in bf16 against fp32's (the parity reference, equal to
transformers'): how many continuations are identical, and how many tokens each keeps
before its first difference. Then, teacher-forced on fp32's continuation (the prompt plus
fp32's tokens as one sequence, through transformers in both dtypes), the top-1 agreement
and the largest drop in log-probability of fp32's token. Fast: a decode step's wall time
at batch 1 and 32 and the prefill rate of a 512-token prompt, per dtype (best of three),
and their ratio. Run it on a quiet machine.
"""

import json
import time
from dataclasses import dataclass
from pathlib import Path

PROMPTS = (
    "The history of the printing press begins",
    "Explain to a new programmer why tests matter:",
    "def fibonacci(n):",
    "The three largest cities in France are",
    "Write a short poem about the sea.",
    "Photosynthesis is the process by which",
    "To make bread at home, first",
    "The difference between a list and a tuple in Python is",
    "Once upon a time, in a small village,",
    "The main causes of the First World War were",
    "A good way to learn a new language is",
    "SELECT name, COUNT(*) FROM orders",
    "The speed of light in a vacuum is",
    "Here is a recipe for a simple tomato soup:",
    "In economics, inflation means",
    "The best advice for a first job interview is",
)


@dataclass
class DtypeBenchOptions:
    model_dir: Path
    out: Path
    num_tokens: int = 48
    dtypes: tuple[str, str] = ("float32", "bfloat16")


def _engine(model_dir: Path, dtype: str):
    from workers.engine.config import EngineConfig, SchedulerConfig
    from workers.engine.llm_engine import LLMEngine

    config = EngineConfig(
        dtype=dtype,
        kv_cache_gib=0.375,
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048),
    )
    return LLMEngine.from_pretrained(model_dir, config)


def _speed(engine, repeats: int = 3) -> dict:
    """Wall times measured here, the best of `repeats`: a decode step at batch 1 and at
    batch 32 (32 tokens each after a 16-token prompt, less the prefill step), and the
    prefill rate of one 512-token prompt."""
    import random

    from workers.engine.sampling_params import SamplingParams

    rng = random.Random(0)
    vocab = engine.runner.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def timed(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        best = float("inf")
        for _ in range(repeats):
            batch = [prompt(len(p)) for p in prompts]  # fresh tokens: no prefix-cache hit
            started = time.perf_counter()
            engine.generate(batch, params)
            best = min(best, time.perf_counter() - started)
        return best

    decode: dict[int, float] = {}
    for batch in (1, 32):
        short = timed([prompt(16)] * batch, 1)  # the prefill step alone
        decode[batch] = (timed([prompt(16)] * batch, 33) - short) / 32
    prefill = timed([prompt(512)], 1)
    return {
        "decode_step_ms_batch1": 1e3 * decode[1],
        "decode_step_ms_batch32": 1e3 * decode[32],
        "prefill_tokens_per_s": 512 / prefill,
    }


def _teacher_forced(model_dir: Path, sequences: list[list[int]], prompt_lens: list[int]) -> dict:
    """transformers in fp32 and bf16 over the same token sequences: at each generated
    position, whether bf16's argmax is fp32's, and the drop in fp32's token's logprob."""
    import torch
    from transformers import AutoModelForCausalLM

    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        with torch.no_grad():
            logits[dtype] = [
                model(torch.tensor([seq])).logits[0].float().log_softmax(-1) for seq in sequences
            ]
        del model
    agree = total = 0
    worst = 0.0
    for i, seq in enumerate(sequences):
        ref, low = logits[torch.float32][i], logits[torch.bfloat16][i]
        for pos in range(prompt_lens[i] - 1, len(seq) - 1):
            token = seq[pos + 1]
            total += 1
            agree += int(low[pos].argmax()) == token
            worst = max(worst, float(ref[pos, token] - low[pos, token]))
    return {"top1_agreement": agree / total if total else None, "max_logprob_drop": worst}


def run_dtype_bench(opts: DtypeBenchOptions) -> dict:
    from workers.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=opts.num_tokens, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    speed: dict[str, dict] = {}
    prompts: list[list[int]] = []
    for dtype in opts.dtypes:
        started = time.perf_counter()
        engine = _engine(opts.model_dir, dtype)
        assert engine.tokenizer is not None, "the bench model needs a tokenizer"
        prompts = [engine.tokenizer.encode(p, True) for p in PROMPTS]
        outputs[dtype] = [c.token_ids for c in engine.generate(prompts, params)]
        speed[dtype] = _speed(engine)
        print(f"  {dtype}: loaded, generated and timed in {time.perf_counter() - started:.1f} s")
    ref_dtype, low_dtype = opts.dtypes
    ref, low = outputs[ref_dtype], outputs[low_dtype]
    kept = [_common_prefix(a, b) for a, b in zip(ref, low, strict=True)]
    sequences = [p + r for p, r in zip(prompts, ref, strict=True)]
    forced = _teacher_forced(opts.model_dir, sequences, [len(p) for p in prompts])
    result = {
        "model_dir": str(opts.model_dir),
        "num_prompts": len(PROMPTS),
        "num_tokens": opts.num_tokens,
        "identical": sum(k == opts.num_tokens for k in kept),
        "tokens_before_first_difference": kept,
        "mean_tokens_before_first_difference": sum(kept) / len(kept),
        "teacher_forced": forced,
        "speed": speed,
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=2))
    print(_table(result, ref_dtype, low_dtype))
    print(f"report: {opts.out}")
    return result


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _table(r: dict, ref: str, low: str) -> str:
    s = r["speed"]
    lines = [
        f"\n{low} against {ref}, {r['num_prompts']} prompts x {r['num_tokens']} greedy tokens",
        f"  identical continuations          {r['identical']}/{r['num_prompts']}",
        f"  tokens before the first change   mean {r['mean_tokens_before_first_difference']:.1f}",
        f"  top-1 agreement (teacher-forced) {r['teacher_forced']['top1_agreement']:.4f}",
        f"  largest logprob drop             {r['teacher_forced']['max_logprob_drop']:.3f}",
        "",
        f"{'':26}{ref:>12}{low:>12}{'ratio':>8}",
    ]
    for key, label, higher_better in (
        ("decode_step_ms_batch1", "decode step, batch 1 (ms)", False),
        ("decode_step_ms_batch32", "decode step, batch 32 (ms)", False),
        ("prefill_tokens_per_s", "prefill (tokens/s)", True),
    ):
        a, b = s[ref][key], s[low][key]
        ratio = b / a if higher_better else a / b
        lines.append(f"{label:26}{a:12.1f}{b:12.1f}{ratio:7.2f}x")
    return "\n".join(lines)
