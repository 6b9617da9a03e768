"""A model split over two ranks (gloo, two processes) computes what one device computes.

Rank 0 is this test process; rank 1 is a child process. Greedy output with N = 2 equals
the N = 1 engine's and transformers' for the same checkpoint, and logprobs agree with
transformers' forward pass within fp32 tolerance.
"""

import os
import random
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import VOCAB, load_reference, reference_greedy
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.tp.config import ShardConfig
from workers.tp.launch import sharded_engine

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine_config(num_blocks: int = 256) -> EngineConfig:
    # Chunks of at most 7 under a 16-token budget: prefill chunks with cached context and
    # decodes share steps; rows of 48 tokens: workspace decodes and block-gather decodes.
    return EngineConfig(
        num_kv_blocks=num_blocks,
        block_size=4,
        decode_workspace_tokens=48,
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_prefill_chunk=7),
    )


@pytest.fixture
def sharded(request):
    """`sharded(path, config)`: an engine over two ranks, closed after the test; rank 0
    (this process) is pinned to its slice of the cores while the group runs and has all
    of them back once it is closed."""
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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_match_one_device_and_transformers(arch, checkpoints, sharded):
    path = checkpoints[arch]
    ref = load_reference(path)
    batch = prompts(4, seed=11, lo=5, hi=45)
    two = sharded(path, engine_config())
    # The shard holds half the KV heads, so each rank's cache has half the bytes per token.
    assert two.runner.kv_caches[0][0].shape[0] == ref.config.num_key_value_heads // 2
    one = LLMEngine.from_pretrained(path, engine_config())
    got_two = two.generate(batch, GREEDY)
    got_one = one.generate(batch, GREEDY)
    for prompt, a, b in zip(batch, got_one, got_two, strict=True):
        expected = reference_greedy(ref, prompt, GREEDY.max_tokens)
        assert b.token_ids == a.token_ids == expected

    # Logprobs from the logits gathered over the vocabulary shards, against transformers.
    prompt = prompts(1, seed=12, lo=25, hi=25)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    req = two.add_request(prompt_token_ids=prompt, params=params)
    logprobs = []
    while two.has_unfinished_requests():
        for out in two.step():
            logprobs += out.logprobs or []
    with torch.no_grad():
        full = torch.tensor([prompt + req.output_token_ids[:-1]])
        expected = ref(full).logits[0, len(prompt) - 1 :].log_softmax(-1)
    assert len(logprobs) == params.max_tokens
    for i, lp in enumerate(logprobs):
        vals, ids = expected[i].topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), vals, atol=5e-5, rtol=1e-5)


def test_two_ranks_match_transformers_through_preemption(llama_dir, sharded):
    ref = load_reference(llama_dir)
    batch = prompts(5, seed=13, lo=20, hi=40)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine = sharded(llama_dir, engine_config(num_blocks=36))  # far fewer than 5 x ~60 tokens
    results = engine.generate(batch, params)
    assert sum(r.num_preemptions for r in results) > 0
    for prompt, result in zip(batch, results, strict=True):
        assert result.token_ids == reference_greedy(ref, prompt, params.max_tokens)
