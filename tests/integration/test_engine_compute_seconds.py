"""Compute seconds: the engine charges each request its share of every step it was in (its
tokens over the step's, times the step's wall time), prefill and decode apart, so the
requests' charges add up to the engine's time and a request alone pays its steps."""

import time
from pathlib import Path

import pytest

from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def make_engine(path: Path, num_kv_blocks: int = 64, **sched) -> LLMEngine:
    cfg = EngineConfig(
        num_kv_blocks=num_kv_blocks, block_size=4, scheduler=SchedulerConfig(**sched)
    )
    return LLMEngine.from_pretrained(path, cfg)


def run_steps(engine: LLMEngine) -> tuple[list[float], dict[str, RequestOutput]]:
    """Step to the end: each step's wall time as the engine counted it (checked against
    the test's own clock around the step), and each request's last output."""
    step_s: list[float] = []
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        before, started = engine.step_time_s, time.perf_counter()
        outs = engine.step()
        outside_s = time.perf_counter() - started
        step_s.append(engine.step_time_s - before)
        assert 0 < step_s[-1] <= outside_s
        last.update((o.request_id, o) for o in outs)
    return step_s, last


def test_two_prompts_in_one_batch_share_each_step_by_their_tokens(llama_dir):
    engine = make_engine(llama_dir)
    long = engine.add_request("long", prompt_token_ids=list(range(100, 130)), params=PARAMS)
    short = engine.add_request("short", prompt_token_ids=list(range(5, 11)), params=PARAMS)
    step_s, last = run_steps(engine)
    # One step prefills both (30 + 6 tokens) and samples their first tokens; four decode both.
    assert len(step_s) == 5
    charged = sum(r.prefill_s + r.decode_s for r in (long, short))
    assert charged == pytest.approx(sum(step_s), rel=1e-6)
    assert engine.step_time_s == pytest.approx(sum(step_s), rel=1e-9)
    assert long.prefill_s == pytest.approx(step_s[0] * 30 / 36, rel=1e-9)
    assert short.prefill_s == pytest.approx(step_s[0] * 6 / 36, rel=1e-9)
    assert long.prefill_s > short.prefill_s
    assert long.decode_s == pytest.approx(sum(step_s[1:]) / 2, rel=1e-9)
    assert short.decode_s == pytest.approx(long.decode_s, rel=1e-9)
    for req in (long, short):  # the last output carries them out
        out = last[req.request_id]
        assert out.finished and (out.prefill_s, out.decode_s) == (req.prefill_s, req.decode_s)


def test_a_request_alone_pays_its_steps_the_last_prompt_chunk_as_prefill(llama_dir):
    # 9 prompt tokens in chunks of 4, 4 and 1: the one-token chunk samples the first token
    # and is prefill, though the scheduler packs it like a decode.
    engine = make_engine(llama_dir, max_prefill_chunk=4)
    req = engine.add_request("alone", prompt_token_ids=list(range(5, 14)), params=PARAMS)
    step_s, last = run_steps(engine)
    assert len(step_s) == 3 + 4
    assert req.prefill_s == pytest.approx(sum(step_s[:3]), rel=1e-9)
    assert req.decode_s == pytest.approx(sum(step_s[3:]), rel=1e-9)
    assert req.prefill_s + req.decode_s == pytest.approx(engine.step_time_s, rel=1e-9)
    assert (last["alone"].prefill_s, last["alone"].decode_s) == (req.prefill_s, req.decode_s)


def test_a_preempted_request_pays_its_recompute_and_the_charges_still_add_up(llama_dir):
    # 8 blocks of 4 tokens: two 8-token prompts growing to 24 tokens each cannot both fit,
    # so one is preempted by recompute and prefilled again later.
    engine = make_engine(llama_dir, num_kv_blocks=8)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    reqs = [
        engine.add_request(rid, prompt_token_ids=list(range(s, s + 8)), params=params)
        for rid, s in (("a", 5), ("b", 50))
    ]
    step_s, last = run_steps(engine)
    assert engine.scheduler.num_preemptions >= 1
    victim = next(r for r in reqs if r.num_preemptions)
    other = next(r for r in reqs if r is not victim)
    assert other.num_preemptions == 0
    # Both were prefilled together in the first step; only the victim prefilled again.
    assert other.prefill_s == pytest.approx(step_s[0] / 2, rel=1e-9)
    assert victim.prefill_s > step_s[0] / 2
    charged = sum(r.prefill_s + r.decode_s for r in reqs)
    assert charged == pytest.approx(sum(step_s), rel=1e-6)
    assert all(last[r.request_id].num_output_tokens == 16 for r in reqs)
