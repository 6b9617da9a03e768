"""Decode steps from per-bucket graphs (`workers.runner.decode_graphs`).

On the CPU the buckets run in "eager" mode: the same padding, sink slot, static buffers
and first-replay check as on CUDA, without the recording. The CUDA test records real
graphs and runs where a GPU is present.
"""

import logging
import random
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import VOCAB, load_reference, reference_greedy
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.runner.decode_graphs import (
    DecodeGraphs,
    _Graph,
    batch_buckets,
    bucket_for,
    context_buckets,
)


def make_engine(path: Path, graphs: str, device: str = "cpu", **kw) -> LLMEngine:
    cfg = EngineConfig(
        num_kv_blocks=256,
        block_size=4,
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16),
        decode_graphs=graphs,
        device=device,
        **kw,
    )
    return LLMEngine.from_pretrained(path, cfg)


def prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(llama_dir: Path):
    return load_reference(llama_dir)


def greedy_matches_transformers(engine, reference, caplog, num_prompts: int, seed: int) -> None:
    """Generate greedily (errors of the decode graphs captured in `caplog`) and check the
    tokens against transformers'."""
    ps = prompts(num_prompts, seed)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.ERROR, logger="workers.runner.decode_graphs"):
        results = engine.generate(ps, greedy)
    for p, r in zip(ps, results, strict=True):
        assert r.token_ids == reference_greedy(reference, p, 10)


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]
    assert context_buckets(1024) == [64, 128, 256, 512, 1024]
    assert context_buckets(600) == [64, 128, 256, 512, 600]
    assert context_buckets(48) == [48]
    assert [bucket_for(v, [1, 2, 4, 8]) for v in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]


def test_config_names_the_modes():
    with pytest.raises(ValueError, match="decode_graphs must be one of auto, off, eager"):
        EngineConfig(decode_graphs="always")


def test_auto_is_off_on_the_cpu(llama_dir):
    engine = make_engine(llama_dir, "auto")
    assert engine.runner.graphs is None
    # No sink block either: the pool is exactly the planned blocks.
    assert engine.runner.kv_caches[0][0].shape[1] == 256 * 4


def test_bucketed_decode_steps_match_transformers(llama_dir, reference):
    """Batches that shrink as requests end (each pads up to its bucket) and contexts that
    cross bucket edges, against transformers' greedy output."""
    engine = make_engine(llama_dir, "eager")
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.capture
    sink = engine.runner.kv_caches[0][0].shape[1] - 4
    assert graphs.sink_slot == sink == 256 * 4
    ps = prompts(7, seed=11, lo=20, hi=60)
    lengths = [5, 9, 14, 20, 30, 40, 70]  # batch 7 -> 6 -> ... -> 1: buckets 8, 4, 2, 1
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths]
    results = engine.generate(ps, params)
    for prompt, m, result in zip(ps, lengths, results, strict=True):
        assert result.token_ids == reference_greedy(reference, prompt, m)
    assert graphs.enabled
    batches = {b for b, _ in graphs.graphs}
    contexts = {c for _, c in graphs.graphs}
    assert {8, 4, 2, 1} <= batches
    assert {64, 128} <= contexts  # the longest request decodes past 64 tokens
    assert graphs.replays > len(graphs.graphs) and graphs.padded_rows > 0
    # Padding rows wrote their K/V to the sink block, past the pool's 256 blocks.
    k_cache = engine.runner.kv_caches[0][0]
    assert k_cache[:, sink].abs().sum() > 0
    assert engine.kv.num_free_blocks == 256


def test_decode_steps_beside_prefill_run_eagerly(llama_dir, reference):
    """Requests arriving while others decode: steps with a prefill chunk take the eager
    path, pure decode steps the graphs, and the workspace rows move under both."""
    engine = make_engine(llama_dir, "eager")
    graphs = engine.runner.graphs
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ps = prompts(5, seed=12)
    done = {}
    pending = list(enumerate(ps))
    engine.add_request(str(pending[0][0]), prompt_token_ids=pending[0][1], params=greedy)
    pending = pending[1:]
    steps = 0
    while engine.has_unfinished_requests() or pending:
        if pending and steps % 3 == 2:
            i, p = pending.pop(0)
            engine.add_request(str(i), prompt_token_ids=p, params=greedy)
        for out in engine.step():
            done.setdefault(int(out.request_id), []).extend(out.new_token_ids)
        steps += 1
    for i, p in enumerate(ps):
        assert done[i] == reference_greedy(reference, p, 12)
    assert graphs.enabled and graphs.replays > 0
    assert steps > graphs.replays  # some steps had a prefill: eager


def test_a_graph_that_disagrees_turns_graphs_off(llama_dir, reference, caplog):
    engine = make_engine(llama_dir, "eager")
    graphs = engine.runner.graphs
    real_record = graphs._record

    def wrong_record(batch, context):
        eager, _ = real_record(batch, context)
        out = torch.zeros_like(eager)

        def replay():
            out.copy_(eager)
            out[:, 7] += 100.0  # token 7 always wins: a graph that reads stale inputs

        return eager, _Graph(replay, out)

    graphs._record = wrong_record
    greedy_matches_transformers(engine, reference, caplog, num_prompts=3, seed=13)
    assert not graphs.enabled and not graphs.graphs and graphs.replays == 0
    assert "decode graphs off" in caplog.text and "first replay" in caplog.text


def test_a_capture_that_fails_turns_graphs_off(llama_dir, reference, caplog):
    engine = make_engine(llama_dir, "eager")
    graphs = engine.runner.graphs

    def failing_record(batch, context):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs._record = failing_record
    greedy_matches_transformers(engine, reference, caplog, num_prompts=2, seed=14)
    assert not graphs.enabled
    assert "capturing batch 2, context 64 failed" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_match_the_eager_engine(llama_dir, dtype):
    """On a GPU: captured graphs give the eager engine's tokens, and steps replay them."""
    ps = prompts(6, seed=15, lo=20, hi=60)
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        for m in (6, 11, 17, 30, 45, 70)
    ]
    eager = make_engine(llama_dir, "off", device="cuda", dtype=dtype)
    want = [r.token_ids for r in eager.generate(ps, params)]
    engine = make_engine(llama_dir, "auto", device="cuda", dtype=dtype)
    graphs = engine.runner.graphs
    assert isinstance(graphs, DecodeGraphs) and graphs.capture
    got = [r.token_ids for r in engine.generate(ps, params)]
    assert got == want
    assert graphs.enabled and graphs.replays > len(graphs.graphs) > 1
