"""Start-up calibration: what a step costs, measured before the first request.

The step model (`workers.engine.step_model`) learns from the steps the engine runs, and
until it has seen `min_samples` of them it knows nothing: the scheduler bounds the batch
by `max_num_seqs` and the token budget alone, and /load reports no capacity, so a gateway
admits a cold replica's first burst blind. Measured on this repository's `bench slo` at 3x
the tour's load against a cold stack: the large pool took 32 requests at once, prefilled
them in 5 s steps, and its accepted TTFT p99 was 33 s against a 2 s target.

So a worker runs a fixed plan of synthetic steps while it still reports `loading`: one
unmeasured round first (the first steps of a process pay for allocations and kernel
set-up), then prefill-heavy rounds of one sequence at a few prompt lengths and decode
rounds at batch sizes 1, 2, 4, ... up to `max_num_seqs`. The requests are ordinary
requests with random prompts under a salt of their own (their KV blocks are free and
reusable afterwards; no real prompt can hit them); the counters the worker reports are
put back as they were, so /metrics and usage never see calibration.
"""

import logging
import random
import time
from dataclasses import dataclass

from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_SALT = "switchyard-calibration"
DECODE_PROMPT_TOKENS = 16  # each sequence of a decode round: one block of prompt
DECODE_STEPS = 4  # output tokens per request: its prefill step, then decode steps
PREFILL_LENGTHS = (64, 256, 768)  # one-sequence rounds, capped by the budget and length


@dataclass(frozen=True, slots=True)
class Calibration:
    """What a calibration ran, and whether it left a fit (False: the samples pinned none)."""

    num_steps: int
    seconds: float
    fitted: bool


def plan(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, kv_tokens: int
) -> list[tuple[int, int]]:
    """The rounds, as (sequences, prompt tokens each): prefill rounds of one sequence,
    then decode rounds of 1, 2, 4, ... sequences up to `max_num_seqs` (and the last at
    `max_num_seqs` itself), none needing more KV than `kv_tokens` or a longer context
    than `max_model_len`."""
    rounds: list[tuple[int, int]] = []
    longest = min(max_num_batched_tokens, max_model_len - DECODE_STEPS, kv_tokens - DECODE_STEPS)
    for length in PREFILL_LENGTHS:
        length = min(length, longest)
        if length >= 1 and (1, length) not in rounds:
            rounds.append((1, length))
    per_seq = DECODE_PROMPT_TOKENS + DECODE_STEPS
    most = max(1, min(max_num_seqs, kv_tokens // per_seq))
    prompt = max(1, min(DECODE_PROMPT_TOKENS, max_model_len - DECODE_STEPS))
    size = 1
    while size < most:
        rounds.append((size, prompt))
        size *= 2
    rounds.append((most, prompt))
    return rounds


def calibrate(engine: LLMEngine, seed: int = 0) -> Calibration:
    """Run the plan on `engine` (idle: nothing else is in it) and fit its step model.
    On a failure (a step that fails) the error is raised with the engine left idle, its
    step model empty, and its counters as they were."""
    if engine.has_unfinished_requests():
        raise RuntimeError("calibration needs an idle engine")
    sched = engine.scheduler.config
    kv_tokens = engine.kv.num_total_blocks * engine.kv.block_size
    rounds = plan(sched.max_num_seqs, sched.max_num_batched_tokens, engine.max_model_len, kv_tokens)
    rng = random.Random(seed)
    vocab = engine.runner.model_config.vocab_size
    started = time.perf_counter()
    steps = 0
    with engine.uncounted():
        try:
            _run_round(engine, rng, vocab, 1, rounds[0][1], "warm")  # unmeasured
            engine.step_model.reset()
            for i, (num_seqs, prompt_tokens) in enumerate(rounds):
                steps += _run_round(engine, rng, vocab, num_seqs, prompt_tokens, str(i))
            engine.step_model.refit()
        except Exception:  # leave the engine idle and unfitted: it learns from live steps
            for request_id in list(engine.scheduler.requests):
                engine.abort(request_id)
            engine.step_model.reset()
            raise
    seconds = time.perf_counter() - started
    result = Calibration(steps, seconds, engine.step_model.fitted)
    fit = engine.step_model.fit
    if fit is None:
        log.warning("calibration: %d steps in %.1f s pinned no step model", steps, seconds)
    else:
        log.info(
            "calibration: %d steps in %.1f s: step = %.2f ms + %.3f ms/seq + %.4f ms/token"
            " + %.6f ms/context token; %d seats within the ITL target",
            steps,
            seconds,
            fit.base_s * 1e3,
            fit.per_seq_s * 1e3,
            fit.per_token_s * 1e3,
            fit.per_context_s * 1e3,
            engine.scheduler.seats(),
        )
    return result


def _run_round(
    engine: LLMEngine, rng: random.Random, vocab: int, num_seqs: int, prompt_tokens: int, tag: str
) -> int:
    # One token a step: the step model learns plain decode steps (no speculation).
    params = SamplingParams(
        max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True, num_speculative_tokens=0
    )
    for j in range(num_seqs):
        ids = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        request = engine.make_request(
            f"calibrate-{tag}-{j}", prompt_token_ids=ids, params=params, cache_salt=_SALT
        )
        refused = engine.add(request)
        if refused is not None:
            raise RuntimeError(f"calibration request refused: {refused.error}")
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.error is not None:
                raise RuntimeError(f"calibration request failed: {output.error}")
        steps += 1
    return steps
