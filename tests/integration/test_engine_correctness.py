"""The engine's greedy output equals transformers' for the same checkpoint."""

import random
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import ARCHITECTURES, VOCAB, load_reference, reference_greedy
from tests.support.cpu import runs_native_kernels
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.runner.plan import AVX2_SDPA_PROMPTS_OVER

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def make_engine(
    path: Path,
    *,
    num_blocks: int = 256,
    budget: int = 512,
    workspace: int = 1024,
    native: bool = True,
    **kw,
) -> LLMEngine:
    sched = SchedulerConfig(max_num_batched_tokens=budget, **kw)
    cfg = EngineConfig(
        num_kv_blocks=num_blocks,
        block_size=4,
        scheduler=sched,
        decode_workspace_tokens=workspace,
        native_kernels=native,
        packed_weights=native,
    )
    engine = LLMEngine.from_pretrained(path, cfg)
    # The CPU fast path (native kernels, packed weights) unless asked not to, every run;
    # without it, torch's own ops throughout: the reference configuration.
    assert (engine.runner.decode_kernel is not None) == (native and workspace > 0)
    assert engine.runner.fused_ops == engine.runner.packed == native
    return engine


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]):
    return {arch: load_reference(path) for arch, path in checkpoints.items()}


@pytest.mark.parametrize("native", [True, False], ids=["cpu-fast-path", "torch-ops"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_batch_of_mixed_lengths_matches_transformers(arch, native, checkpoints, references):
    prompts = make_prompts(6, seed=1)
    engine = make_engine(checkpoints[arch], native=native)
    results = engine.generate(prompts, GREEDY)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_greedy(references[arch], prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "workspace", [1024, 48, 0], ids=["workspace", "workspace+gather", "block-gather"]
)
def test_greedy_with_forced_chunked_prefill_matches_transformers(
    arch, workspace, checkpoints, references
):
    prompts = make_prompts(4, seed=2, lo=30, hi=90)
    engine = make_engine(checkpoints[arch], budget=16, max_prefill_chunk=7, workspace=workspace)
    results = engine.generate(prompts, GREEDY)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_greedy(references[arch], prompt, GREEDY.max_tokens)


def test_greedy_with_prefix_cache_hits_matches_transformers(llama_dir, references):
    shared = make_prompts(1, seed=3, lo=40, hi=40)[0]
    prompts = [shared + tail for tail in make_prompts(4, seed=4, lo=1, hi=9)]
    engine = make_engine(llama_dir)
    first = engine.generate(prompts[:1], GREEDY)
    rest = engine.generate(prompts[1:], GREEDY)
    assert first[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens >= 36 for r in rest)
    for prompt, result in zip(prompts, first + rest, strict=True):
        assert result.token_ids == reference_greedy(references["llama"], prompt, GREEDY.max_tokens)
    # A prompt that is entirely cached still recomputes its last token.
    again = engine.generate(prompts[:1], GREEDY)[0]
    assert again.num_cached_tokens == (len(prompts[0]) - 1) // 4 * 4
    assert again.token_ids == first[0].token_ids


@pytest.mark.parametrize("workspace", [1024, 0], ids=["workspace", "block-gather"])
def test_greedy_with_forced_preemption_matches_transformers(workspace, llama_dir, references):
    prompts = make_prompts(6, seed=5, lo=20, hi=40)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # 40 blocks of 4 = 160 tokens: far less than the 6 x ~70 the batch needs.
    engine = make_engine(llama_dir, num_blocks=40, workspace=workspace)
    results = engine.generate(prompts, params)
    assert sum(r.num_preemptions for r in results) > 0
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_greedy(references["llama"], prompt, params.max_tokens)
    assert engine.kv.num_free_blocks == 40


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logprobs_match_transformers_forward_in_fp32(arch, checkpoints, references):
    prompt = make_prompts(1, seed=6, lo=25, hi=25)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    engine = make_engine(checkpoints[arch], budget=10)
    req = engine.add_request(prompt_token_ids=prompt, params=params)
    logprobs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs += out.logprobs or []
    full = torch.tensor([prompt + req.output_token_ids[:-1]])
    with torch.no_grad():
        ref = references[arch](full).logits[0, len(prompt) - 1 :].log_softmax(-1)
    assert len(logprobs) == params.max_tokens
    for i, lp in enumerate(logprobs):
        ids = [t for t, _ in lp.top]
        vals = torch.tensor([v for _, v in lp.top])
        ref_vals, ref_ids = ref[i].topk(5)
        assert ids == ref_ids.tolist()
        torch.testing.assert_close(vals, ref_vals, atol=2e-5, rtol=1e-5)
        assert lp.logprob == pytest.approx(ref[i, req.output_token_ids[i]].item(), abs=2e-5)


@pytest.fixture(scope="module")
def head64(tmp_path_factory):
    """Llama with head dim 64, the shape the native prompt-attention kernel takes (the
    tiny checkpoints' head dim of 16 runs SDPA), and its transformers reference."""
    from tests.support.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("head64") / "llama", "llama", hidden_size=256, intermediate_size=256
    )
    return path, load_reference(path)


@pytest.mark.parametrize("case", ["whole-prompts", "chunks-after-context", "prefix-hits"], ids=str)
def test_native_prompt_attention_in_fp32_matches_transformers(case, head64):
    """Whole prompts, chunks reading their context through a view of the cache, and
    prefix hits (context gathered from blocks) all attend in the native kernel."""
    path, reference = head64
    if case == "chunks-after-context":
        engine = make_engine(path, budget=16, max_prefill_chunk=7)
        prompts = make_prompts(4, seed=7, lo=30, hi=90)
    else:
        engine = make_engine(path)
        # (seed 8 has a near-tie at one position that SDPA and torch's ops flip too)
        prompts = make_prompts(5, seed=11, lo=3, hi=60)
    assert (engine.runner.prefill_kernel is not None) == runs_native_kernels("float32")
    # These prompts are all shorter than the limit past which an AVX2 CPU sends whole
    # prompts to SDPA instead.
    avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2" and runs_native_kernels("float32")
    assert engine.runner.sdpa_prompts_over == (AVX2_SDPA_PROMPTS_OVER if avx2 else None)
    if case == "prefix-hits":
        shared = make_prompts(1, seed=9, lo=40, hi=40)[0]
        prompts = [shared + tail for tail in make_prompts(4, seed=10, lo=5, hi=20)]
        engine.generate(prompts[:1], GREEDY)
    results = engine.generate(prompts, GREEDY)
    if case == "prefix-hits":
        assert all(r.num_cached_tokens >= 36 for r in results)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_greedy(reference, prompt, GREEDY.max_tokens)
