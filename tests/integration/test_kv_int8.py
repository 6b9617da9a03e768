"""The engine with an int8 KV cache (`kv_cache_dtype="int8"`) against the same checkpoint
without it, and the engine's features on it: prefix caching, preemption, structured output,
decode graphs (eager), its pool size; tensor parallelism in test_tensor_parallel_kv_int8.py.

Closeness: on the int8 engine's own greedy trajectory, transformers in fp32 (the fp32 engine
without int8 KV: its greedy output equals transformers', test_engine_correctness.py),
teacher-forced, must give the chosen tokens nearly the same log-probability and mostly the
same argmax. The bounds are the bf16 closeness test's (0.15 worst gap, 90% agreement): int8
KV alone perturbs the logits about as much as bf16 throughout the model. Measured on these
checkpoints: worst gap 0.009-0.087 and mean 0.002-0.017 with int8 KV in fp32, against
0.014-0.072 and 0.004-0.018 for bf16 without it; agreement 93-96 of 96 tokens for both
(the tiny random models have near-ties, which either side of any rounding can flip).
A quantization step is at most a row's largest value / 254 (0.4%), which bf16's rounding of
every number (up to 0.2% of itself) matches on the row's largest values.
"""

import pytest
import torch

from tests.integration.test_engine_correctness import make_prompts
from tests.support.checkpoints import load_reference
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import GrammarSpec
from workers.runner.kv_int8 import Int8KV

NUM_TOKENS = 16
PARAMS = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory):
    """Llama with head dim 64, where the native prompt kernel runs (the tiny checkpoints'
    head dim 16 runs SDPA; the int8 decode kernels take both)."""
    from tests.support.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("head64") / "llama", "llama", hidden_size=256, intermediate_size=256
    )


def int8_engine(path, *, native=True, workspace=1024, num_blocks=256, dtype="float32", **kw):
    scheduler = kw.pop(
        "scheduler", SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=24)
    )
    engine = LLMEngine.from_pretrained(
        path,
        EngineConfig(
            dtype=dtype,
            num_kv_blocks=num_blocks,
            block_size=4,
            decode_workspace_tokens=workspace,
            kv_cache_dtype="int8",
            native_kernels=native,
            packed_weights=native,
            scheduler=scheduler,
            **kw,
        ),
    )
    k_cache = engine.runner.kv_caches[0][0]
    assert isinstance(k_cache, Int8KV) and k_cache.data.dtype == torch.int8
    # The native int8 kernels run where ours do (they build on any CPU), torch's otherwise.
    assert (engine.runner.paged_kernel is not None) == native
    assert (engine.runner.decode_kernel is not None) == (native and workspace > 0)
    return engine


def run(engine, prompts, params):
    """Each prompt's (output tokens, chosen-token logprobs), all in one batch."""
    reqs = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    chosen: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished_requests():
        for o in engine.step():
            chosen[o.request_id] += [lp.logprob for lp in o.logprobs or []]
    return [(list(r.output_token_ids), chosen[r.request_id]) for r in reqs]


def closeness(path, prompts, results) -> tuple[float, float, float]:
    """(worst and mean |logprob gap| of the chosen tokens, top-1 agreement) against
    transformers fp32 teacher-forced on each prompt and its output."""
    ref = load_reference(path)
    gaps: list[float] = []
    agree = total = 0
    for prompt, (out, chosen) in zip(prompts, results, strict=True):
        assert len(out) == len(chosen)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + out])).logits[0].float()
        logp = logits[len(prompt) - 1 : -1].log_softmax(-1)
        ref_chosen = logp.gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
        gaps += (torch.tensor(chosen) - ref_chosen).abs().tolist()
        agree += (logp.argmax(-1) == torch.tensor(out)).sum().item()
        total += len(out)
    return max(gaps), sum(gaps) / len(gaps), agree / total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-head64"])
@pytest.mark.parametrize("path_kind", ["native-workspace", "native-paged", "torch"], ids=str)
def test_int8_kv_is_close_to_the_fp32_engine_without_it(
    dtype, arch, path_kind, checkpoints, head64_dir
):
    path = head64_dir if arch == "llama-head64" else checkpoints[arch]
    native = path_kind != "torch"
    engine = int8_engine(
        path, native=native, workspace=0 if path_kind == "native-paged" else 1024, dtype=dtype
    )
    prompts = make_prompts(6, seed=5, lo=10, hi=60)
    worst, mean, agreement = closeness(path, prompts, run(engine, prompts, PARAMS))
    assert worst < 0.15, f"chosen-token log-probs differ by up to {worst:.3f}"
    assert mean < 0.04, f"chosen-token log-probs differ by {mean:.4f} on average"
    assert agreement >= 0.9, f"top-1 agreement {agreement:.3f}"


def test_the_native_kernels_and_torch_read_the_same_int8_cache(head64_dir):
    """The C++ write quantizes to torch's bits and the kernels attend over the same values:
    greedy tokens equal, logprobs close. Not within fp32 arithmetic of each other: the
    native linear layers and fused ops differ from torch's in the last bits of fp32 (1e-5
    in logprobs without int8 KV), and a key at a rounding boundary of the int8 grid moves a
    whole step (measured: up to 5e-4)."""
    prompts = make_prompts(4, seed=7, lo=20, hi=70)
    fast = run(int8_engine(head64_dir), prompts, GREEDY)
    slow = run(int8_engine(head64_dir, native=False), prompts, GREEDY)
    for (a, la), (b, lb) in zip(fast, slow, strict=True):
        assert a == b
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), atol=3e-3, rtol=0)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_prefix_served_from_int8_blocks_gives_what_recomputing_it_gives(native, head64_dir):
    """Every attention reads the int8 values (a prompt's own keys as stored), so a prefix
    read back from cached int8 blocks and the same prefix computed afresh attend over the
    same numbers."""
    shared = make_prompts(1, seed=3, lo=40, hi=40)[0]
    prompts = [shared + tail for tail in make_prompts(4, seed=4, lo=1, hi=9)]
    cached = int8_engine(head64_dir, native=native)
    run(cached, prompts[:1], GREEDY)  # fills the prefix cache
    reqs = [cached.add_request(prompt_token_ids=p, params=GREEDY) for p in prompts[1:]]
    hits = {r.request_id: [] for r in reqs}
    while cached.has_unfinished_requests():
        for o in cached.step():
            hits[o.request_id] += [lp.logprob for lp in o.logprobs or []]
    assert all(r.num_cached_tokens >= 36 for r in reqs)
    fresh = run(
        int8_engine(head64_dir, native=native, enable_prefix_caching=False), prompts[1:], GREEDY
    )
    for req, (tokens, logprobs) in zip(reqs, fresh, strict=True):
        assert list(req.output_token_ids) == tokens
        torch.testing.assert_close(
            torch.tensor(hits[req.request_id]), torch.tensor(logprobs), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("workspace", [1024, 0], ids=["workspace", "paged"])
def test_preemption_by_recompute_gives_what_an_unpreempted_run_gives(workspace, head64_dir):
    prompts = make_prompts(6, seed=5, lo=20, hi=40)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # 40 blocks of 4 = 160 tokens: far less than the 6 x ~70 the batch needs.
    small = int8_engine(head64_dir, num_blocks=40, workspace=workspace)
    results = small.generate(prompts, params)
    assert sum(r.num_preemptions for r in results) > 0
    roomy = int8_engine(head64_dir, workspace=workspace).generate(prompts, params)
    for a, b in zip(results, roomy, strict=True):
        assert a.token_ids == b.token_ids
    assert small.kv.num_free_blocks == 40


def test_structured_outputs_validate_on_an_int8_cache_under_preemption(demo_dir):
    import json

    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "ok"],
        "additionalProperties": False,
    }
    engine = LLMEngine.from_pretrained(
        demo_dir,
        EngineConfig(
            num_kv_blocks=12,
            block_size=4,
            kv_cache_dtype="int8",
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        ),
    )
    reqs = [
        engine.add_request(
            prompt="JSON:",
            params=SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True),
            grammar=GrammarSpec.from_schema(schema),
        )
        for i in range(8)
    ]
    texts = {r.request_id: "" for r in reqs}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.new_text
    assert engine.scheduler.num_preemptions > 0
    finished = [r for r in reqs if r.finish_reason.value == "stop"]
    assert finished, "no document completed within max_tokens"
    for r in finished:
        doc = json.loads(texts[r.request_id])
        assert set(doc) == {"age", "ok"} and 18 <= doc["age"] <= 99


def test_decode_graphs_eager_on_an_int8_cache_give_the_plain_steps_output(head64_dir):
    """Graph buckets pad a step with rows writing to a sink block: on an int8 cache too."""
    prompts = make_prompts(3, seed=8, lo=10, hi=30)
    plain = run(int8_engine(head64_dir, native=False), prompts, GREEDY)
    graphed = int8_engine(head64_dir, native=False, decode_graphs="eager")
    assert graphed.runner.graphs is not None
    got = run(graphed, prompts, GREEDY)
    assert graphed.runner.graphs.replays > 0
    for (a, la), (b, lb) in zip(plain, got, strict=True):
        assert a == b
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), atol=1e-4, rtol=0)


def test_the_pool_holds_twice_the_tokens_in_the_same_kv_cache_gib(head64_dir):
    """The runner plans the pool by bytes: an int8 cache of the same budget holds >= 1.9x
    the tokens of a bf16 one (3.9x an fp32 one), and says so."""

    def capacity(dtype: str, kv_cache_dtype: str) -> int:
        engine = LLMEngine.from_pretrained(
            head64_dir,
            EngineConfig(
                dtype=dtype,
                kv_cache_gib=0.01,
                kv_cache_dtype=kv_cache_dtype,
                decode_workspace_tokens=0,
                calibrate=False,
            ),
        )
        runner = engine.runner
        held = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
        assert held <= 0.01 * 2**30
        return runner.kv_capacity_tokens

    bf16, int8_bf16 = capacity("bfloat16", "auto"), capacity("bfloat16", "int8")
    fp32, int8_fp32 = capacity("float32", "auto"), capacity("float32", "int8")
    assert int8_bf16 >= 1.9 * bf16
    assert int8_fp32 >= 3.8 * fp32
