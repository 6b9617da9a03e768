"""An int8 KV cache split over two ranks (gloo, two processes) computes what one device's
int8 cache computes: each rank quantizes and reads its own KV heads, a scale per token and
head, so sharding heads changes nothing of what is stored (the all-reduces change fp32 sums
in their last bits, which the logprobs' tolerance allows)."""

import os
from pathlib import Path

import pytest
import torch

from tests.integration.test_tensor_parallel import prompts
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.runner.kv_int8 import Int8KV
from workers.tp.config import ShardConfig
from workers.tp.launch import sharded_engine

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)


def int8_config(num_blocks: int = 256) -> EngineConfig:
    return EngineConfig(
        num_kv_blocks=num_blocks,
        block_size=4,
        decode_workspace_tokens=48,
        kv_cache_dtype="int8",
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_prefill_chunk=7),
    )


@pytest.fixture
def sharded():
    launchers = []
    cpus = os.sched_getaffinity(0)

    def start(path: Path, config: EngineConfig) -> LLMEngine:
        engine, launcher = sharded_engine(
            path, config, ShardConfig(tensor_parallel=2, collective_timeout_s=60)
        )
        launchers.append(launcher)
        return engine

    yield start
    for launcher in launchers:
        launcher.close()
        assert [p.returncode for p in launcher.procs] == [0]
    assert os.sched_getaffinity(0) == cpus


def outputs(engine: LLMEngine, batch: list[list[int]], params: SamplingParams):
    reqs = [engine.add_request(prompt_token_ids=p, params=params) for p in batch]
    chosen: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished_requests():
        for o in engine.step():
            chosen[o.request_id] += [lp.logprob for lp in o.logprobs or []]
    return reqs, chosen


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_of_int8_kv_match_one_device(arch, checkpoints, sharded):
    path = checkpoints[arch]
    batch = prompts(4, seed=11, lo=5, hi=45)
    two = sharded(path, int8_config())
    cache = two.runner.kv_caches[0][0]
    assert isinstance(cache, Int8KV) and cache.shape[0] == 1  # 2 KV heads over 2 ranks
    one = LLMEngine.from_pretrained(path, int8_config())
    (reqs_two, lp_two), (reqs_one, lp_one) = (
        outputs(two, batch, GREEDY),
        outputs(one, batch, GREEDY),
    )
    for a, b in zip(reqs_two, reqs_one, strict=True):
        assert a.output_token_ids == b.output_token_ids
        torch.testing.assert_close(
            torch.tensor(lp_two[a.request_id]),
            torch.tensor(lp_one[b.request_id]),
            atol=3e-3,
            rtol=0,
        )


def test_two_ranks_of_int8_kv_through_preemption(llama_dir, sharded):
    batch = prompts(5, seed=13, lo=20, hi=40)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine = sharded(llama_dir, int8_config(num_blocks=36))  # far fewer than 5 x ~60 tokens
    results = engine.generate(batch, params)
    assert sum(r.num_preemptions for r in results) > 0
    one = LLMEngine.from_pretrained(llama_dir, int8_config())
    for result, expected in zip(results, one.generate(batch, params), strict=True):
        assert result.token_ids == expected.token_ids
