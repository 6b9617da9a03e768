"""Speculative decoding (n-gram prompt lookup) changes nothing but speed: greedy output is
token for token the engine's without it, a seeded sampled request's too, and the sampled
distribution is the target's; stops, max_tokens, preemption, aborts, the prefix cache and
compute-seconds accounting behave as without it."""

import random
from pathlib import Path

import pytest

from tests.support.checkpoints import VOCAB
from workers.engine.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def make_engine(
    path: Path,
    speculate: bool,
    *,
    num_blocks: int = 256,
    budget: int = 512,
    workspace: int = 1024,
    num_tokens: int = 4,
    block_size: int = 4,
    prefix_caching: bool = True,
    **sched,
) -> LLMEngine:
    cfg = EngineConfig(
        num_kv_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
        decode_workspace_tokens=workspace,
        calibrate=False,
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, **sched),
        speculative=SpeculativeConfig(
            method="ngram" if speculate else "none", num_tokens=num_tokens
        ),
    )
    return LLMEngine.from_pretrained(path, cfg)


def copy_heavy_prompts(n: int, seed: int) -> list[list[int]]:
    """A short random sentence repeated: n-gram lookup finds matches everywhere."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        sentence = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 12))]
        prompts.append((sentence * 8)[: rng.randint(20, 70)])
    return prompts


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 60))] for _ in range(n)]


def test_greedy_output_is_the_engines_without_speculation(checkpoints):
    for arch in ("llama", "qwen3"):
        prompts = copy_heavy_prompts(6, seed=1) + random_prompts(6, seed=2)
        plain = make_engine(checkpoints[arch], False).generate(prompts, GREEDY)
        engine = make_engine(checkpoints[arch], True)
        spec = engine.generate(prompts, GREEDY)
        for a, b in zip(plain, spec, strict=True):
            assert b.token_ids == a.token_ids
            assert b.finish_reason == a.finish_reason
        # Both paths ran: drafts kept and drafts refused.
        assert 0 < engine.num_spec_accepted_tokens < engine.num_spec_proposed_tokens


@pytest.mark.parametrize("workspace", [1024, 0], ids=["decode-workspace", "block-gather"])
def test_greedy_is_unchanged_with_chunked_prefill_and_a_tight_budget(llama_dir, workspace):
    # A 16-token budget: drafts are trimmed to what is left beside the other decodes.
    prompts = copy_heavy_prompts(5, seed=3)
    plain = make_engine(llama_dir, False, budget=16, max_prefill_chunk=7, workspace=workspace)
    spec = make_engine(llama_dir, True, budget=16, max_prefill_chunk=7, workspace=workspace)
    for a, b in zip(plain.generate(prompts, GREEDY), spec.generate(prompts, GREEDY), strict=True):
        assert b.token_ids == a.token_ids
    assert spec.num_spec_accepted_tokens > 0


def test_never_past_max_tokens(llama_dir):
    prompts = copy_heavy_prompts(4, seed=4)
    plain, spec = make_engine(llama_dir, False), make_engine(llama_dir, True)
    for max_tokens in (1, 2, 3, 5, 8, 13):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for a, b in zip(
            plain.generate(prompts, params), spec.generate(prompts, params), strict=True
        ):
            assert b.token_ids == a.token_ids
            assert len(b.token_ids) == max_tokens and b.finish_reason == "length"
    assert spec.num_spec_accepted_tokens > 0


def test_a_stop_token_inside_kept_drafts_ends_the_output_there(llama_dir):
    prompts = copy_heavy_prompts(6, seed=5)
    plain, spec = make_engine(llama_dir, False), make_engine(llama_dir, True)
    free = plain.generate(prompts, GREEDY)
    for prompt, ref in zip(prompts, free, strict=True):
        for at in (3, 9, 17):  # stop at the token first seen there
            stop = ref.token_ids[at]
            params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop])
            a = plain.generate([prompt], params)[0]
            b = spec.generate([prompt], params)[0]
            assert b.token_ids == a.token_ids
            assert b.token_ids[-1] == stop and b.finish_reason == "stop"
    assert spec.num_spec_accepted_tokens > 0


def test_stop_strings_and_min_tokens_behave_as_without_speculation(demo_dir):
    plain, spec = make_engine(demo_dir, False), make_engine(demo_dir, True)
    prompt = "the cat sat on the mat. " * 6
    free = plain.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0))[0]
    assert len(free.text) > 12
    for stop in (free.text[4:7], free.text[10:12], free.text[-3:]):
        params = SamplingParams(max_tokens=48, temperature=0.0, stop=[stop])
        a, b = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert stop not in b.text
    eos = plain.eos_token_ids[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, min_tokens=20, stop_token_ids=[eos])
    a, b = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
    assert b.token_ids == a.token_ids


def test_a_seeded_sampled_request_draws_the_same_tokens(llama_dir):
    # One row of noise per emitted token from the request's generator, as without
    # speculation: the same seed gives the same output, min_tokens and filters included.
    prompts = copy_heavy_prompts(8, seed=6)
    params = [
        SamplingParams(
            max_tokens=30,
            temperature=t,
            top_k=k,
            top_p=p,
            min_tokens=4,
            stop_token_ids=[1, 2],
            logit_bias={prompt[0]: 2.0},
            seed=100 + i,
        )
        for i, (prompt, t, k, p) in enumerate(
            zip(
                prompts,
                [0.3, 0.5, 1.0, 0.2] * 2,
                [0, 8, 0, 3] * 2,
                [1.0, 1.0, 0.9, 1.0] * 2,
                strict=True,
            )
        )
    ]
    plain, spec = make_engine(llama_dir, False), make_engine(llama_dir, True)
    for a, b in zip(plain.generate(prompts, params), spec.generate(prompts, params), strict=True):
        assert b.token_ids == a.token_ids
    assert spec.num_spec_accepted_tokens > 0


def test_per_request_bound_and_opt_in(llama_dir):
    prompts = copy_heavy_prompts(3, seed=7)
    engine = make_engine(llama_dir, True)
    off = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, num_speculative_tokens=0)
    engine.generate(prompts, off)
    assert engine.num_spec_proposed_tokens == 0
    two = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, num_speculative_tokens=2)
    engine.add_request("r", prompt_token_ids=prompts[0], params=two)
    while engine.has_unfinished_requests():
        engine.step()
        req = engine.scheduler.requests.get("r")
        assert req is None or not req.spec_token_ids  # cleared after every step
    assert engine.num_spec_proposed_tokens > 0
    # An opt-in pool: only requests that ask speculate.
    opt_in = make_engine(llama_dir, True)
    opt_in.speculative = SpeculativeConfig(method="ngram", default_on=False)
    opt_in.generate(prompts, GREEDY)
    assert opt_in.num_spec_proposed_tokens == 0
    opt_in.generate(prompts, two)
    assert opt_in.num_spec_proposed_tokens > 0


def test_preemption_and_abort_with_drafts_in_flight(llama_dir):
    # 24 blocks of 4 for 6 requests of up to ~70 tokens: decodes preempt one another.
    prompts = copy_heavy_prompts(6, seed=8)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = make_engine(llama_dir, False).generate(prompts, params)
    engine = make_engine(llama_dir, True, num_blocks=48)
    spec = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
    # An abort while a request has drafts: its blocks are free at once.
    req = engine.add_request(prompt_token_ids=prompts[0], params=params)
    while not req.spec_token_ids:
        engine._propose()
        if not req.spec_token_ids:
            engine.step()
    engine.abort(req.request_id)
    assert engine.kv.pool.num_used_blocks == 0


def test_no_cached_block_holds_a_token_other_than_the_requests(llama_dir):
    """After every step, each block the prefix cache knows for a running request lies
    within its verified tokens and holds exactly them; a later request reusing blocks that
    verify steps wrote gets the same greedy output as a cold engine."""
    prompts = copy_heavy_prompts(4, seed=9)
    engine = make_engine(llama_dir, True)
    bs = engine.kv.block_size
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=GREEDY)
    rejected = 0
    while engine.has_unfinished_requests():
        before = engine.num_spec_proposed_tokens - engine.num_spec_accepted_tokens
        engine.step()
        rejected += engine.num_spec_proposed_tokens - engine.num_spec_accepted_tokens - before
        for req in engine.scheduler.running:
            table = engine.kv.block_table(req.request_id)
            num_registered = engine.kv._num_registered.get(req.request_id, 0)
            assert num_registered * bs <= req.num_computed_tokens
            for j in range(num_registered):
                _, tokens = engine.kv.pool._tokens[table[j]]
                assert list(tokens) == req.all_token_ids[j * bs : (j + 1) * bs]
    assert rejected > 0
    # Prompt + output of r0 as a new prompt: its blocks come from the cache.
    r0 = engine.generate([prompts[0]], GREEDY)[0]
    longer = prompts[0] + r0.token_ids[:30]
    warm = engine.generate([longer], GREEDY)[0]
    assert warm.num_cached_tokens >= 16
    cold = make_engine(llama_dir, False, prefix_caching=False)
    assert warm.token_ids == cold.generate([longer], GREEDY)[0].token_ids


def test_compute_seconds_still_sum_to_step_time_verify_steps_as_decode(llama_dir):
    engine = make_engine(llama_dir, True)
    alone = engine.add_request(prompt_token_ids=copy_heavy_prompts(1, 10)[0], params=GREEDY)
    step_s = []
    while engine.has_unfinished_requests():
        before = engine.step_time_s
        engine.step()
        step_s.append(engine.step_time_s - before)
    assert engine.num_spec_accepted_tokens > 0
    assert len(step_s) < GREEDY.max_tokens  # verify steps emitted several tokens
    # Alone, it pays every step: the one sampling its first token as prefill, the verify
    # steps (and plain decodes) as decode.
    assert alone.prefill_s == pytest.approx(step_s[0], rel=1e-9)
    assert alone.decode_s == pytest.approx(sum(step_s[1:]), rel=1e-9)
    engine = make_engine(llama_dir, True)
    reqs = [
        engine.add_request(prompt_token_ids=p, params=GREEDY) for p in copy_heavy_prompts(3, 11)
    ]
    while engine.has_unfinished_requests():
        engine.step()
    charged = sum(r.prefill_s + r.decode_s for r in reqs)
    assert charged == pytest.approx(engine.step_time_s, rel=1e-6)
    # Drafts are not prompt tokens: the count is the plain engine's.
    plain = make_engine(llama_dir, False)
    plain.generate(copy_heavy_prompts(3, 11), GREEDY)
    assert engine.num_prompt_tokens_computed == plain.num_prompt_tokens_computed
    assert engine.num_generated_tokens == plain.num_generated_tokens


def test_stats_publish_the_draft_counts(llama_dir):
    engine = make_engine(llama_dir, True)
    engine.generate(copy_heavy_prompts(2, seed=11), GREEDY)
    stats = engine.stats(0.0)
    assert stats.num_spec_proposed_tokens == engine.num_spec_proposed_tokens > 0
    assert stats.num_spec_accepted_tokens == engine.num_spec_accepted_tokens > 0
    with engine.uncounted():
        engine.generate(copy_heavy_prompts(2, seed=12), GREEDY)
    assert engine.stats(0.0).num_spec_proposed_tokens == stats.num_spec_proposed_tokens


def test_sampled_distribution_over_2000_seeds_is_the_models(llama_dir):
    """2,000 seeded draws of three tokens (top-k 3, so 27 possible outputs) with
    speculation: their frequencies fit the model's exact probabilities (transformers,
    chi-square at 0.999 over 26 degrees of freedom), and each seed draws what it draws
    without speculation."""
    import torch

    from tests.support.checkpoints import load_reference

    ref = load_reference(llama_dir)
    start = random_prompts(1, seed=13)[0][:8]
    with torch.no_grad():  # the model's own greedy text, which falls into a loop: drafts
        prompt = ref.generate(
            torch.tensor([start]), max_new_tokens=40, do_sample=False, pad_token_id=0
        )[0].tolist()

    def top3(prefix: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = ref(torch.tensor([prefix])).logits[0, -1]
        values, ids = logits.topk(3)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist(), strict=True))

    exact = {}
    for a, pa in top3(prompt).items():
        for b, pb in top3([*prompt, a]).items():
            for c, pc in top3([*prompt, a, b]).items():
                exact[(a, b, c)] = pa * pb * pc
    n = 2000
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=i, ignore_eos=True)
        for i in range(n)
    ]
    big = {"num_blocks": 2048, "budget": 4096, "max_num_seqs": 256}
    engine = make_engine(llama_dir, True, **big)
    spec = engine.generate([prompt] * n, params)
    assert engine.num_spec_accepted_tokens > 100
    assert engine.num_spec_proposed_tokens > engine.num_spec_accepted_tokens + 100
    counts: dict[tuple[int, ...], int] = {}
    for r in spec:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())
    assert chi2 < 54.05, chi2  # chi-square(26) at 0.999
    plain = make_engine(llama_dir, False, **big).generate([prompt] * n, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_each_output_carries_one_token_as_without_speculation(demo_dir):
    # A stream's chunk is one token (the gateway bills a cut-short stream by its chunks).
    prompt = "one two three four. " * 8
    params = SamplingParams(max_tokens=40, temperature=0.0)
    texts = {}
    for speculate in (False, True):
        engine = make_engine(demo_dir, speculate)
        engine.add_request("r", prompt=prompt, params=params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert all(len(o.new_token_ids) == 1 for o in outs)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        texts[speculate] = ("".join(o.new_text for o in outs), len(outs), engine)
    assert texts[True][:2] == texts[False][:2]
    assert texts[True][2].num_spec_accepted_tokens > 0


def test_a_resumed_seeded_stream_continues_as_it_would_have(llama_dir):
    # One row of noise per emitted token, speculating or not: a resume's skip_draws is exact.
    prompt = copy_heavy_prompts(1, seed=14)[0]
    params = SamplingParams(max_tokens=30, temperature=0.2, seed=5, ignore_eos=True)
    whole = make_engine(llama_dir, False).generate([prompt], params)[0].token_ids
    engine = make_engine(llama_dir, True)
    for cut in (3, 11):
        req = engine.add_request(
            prompt_token_ids=prompt, params=params, resume_token_ids=whole[:cut]
        )
        while engine.has_unfinished_requests():
            engine.step()
        assert req.output_token_ids == whole
    assert engine.num_spec_accepted_tokens > 0
