"""The engine's Python API: validation, stopping rules, aborts, deadlines, async streaming."""

import asyncio
from pathlib import Path

import pytest

from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.request import FinishReason
from workers.engine.sampling_params import SamplingParams
from workers.errors import ContextLengthError, InvalidRequestError

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]


def make_engine(path: Path, clock=None, **sched) -> LLMEngine:
    cfg = EngineConfig(num_kv_blocks=64, block_size=4, scheduler=SchedulerConfig(**sched))
    return (
        LLMEngine.from_pretrained(path, cfg, clock=clock)
        if clock
        else LLMEngine.from_pretrained(path, cfg)
    )


def run(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_chunk_context_is_priced_from_the_model_shape_unless_configured(llama_dir):
    engine = make_engine(llama_dir)
    # hidden 64, intermediate 128, 4 heads and 2 KV heads of 16: the linear layers take
    # 64 * (2 * 64 + 2 * 32) + 3 * 64 * 128 = 36,864 multiply-adds per token, attention
    # 2 * 64 = 128 per token of context; so 288, of which the engine takes half.
    assert engine.runner.model_config.attention_parity_context == 288
    assert engine.scheduler.config.attention_parity_context == 144
    assert engine.config.scheduler.attention_parity_context is None  # the caller's, untouched
    configured = make_engine(llama_dir, attention_parity_context=0)
    assert configured.scheduler.config.attention_parity_context == 0


def test_prompt_plus_max_tokens_beyond_context_is_refused(llama_dir):
    engine = make_engine(llama_dir)  # 64 blocks x 4 = 256 tokens of KV, model 512 positions
    with pytest.raises(ContextLengthError) as err:
        engine.add_request(prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=250))
    assert err.value.param == "max_tokens" and err.value.max_model_len == 256
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt_token_ids": []}, "prompt"),
        ({"prompt_token_ids": [1, 10_000]}, "prompt"),
        ({"prompt": "text"}, "prompt"),  # this checkpoint has no tokenizer
    ],
)
def test_bad_prompts_are_refused_naming_the_parameter(llama_dir, kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        make_engine(llama_dir).add_request(**kwargs)
    assert err.value.param == param


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 99}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_stop_token_id_ends_the_request_and_is_reported(llama_dir):
    engine = make_engine(llama_dir)
    free = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[
        0
    ]
    stop_at = free.token_ids[3]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    req = engine.add_request(prompt_token_ids=PROMPT, params=params)
    run(engine)
    first = free.token_ids.index(stop_at)
    assert req.output_token_ids == free.token_ids[: first + 1]
    assert (req.finish_reason, req.stop_reason) == (FinishReason.STOP, stop_at)


def test_min_tokens_defers_a_stop_token(llama_dir):
    engine = make_engine(llama_dir)
    free = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[
        0
    ]
    params = SamplingParams(
        max_tokens=12,
        temperature=0,
        ignore_eos=True,
        stop_token_ids=[free.token_ids[0]],
        min_tokens=4,
    )
    out = engine.generate([PROMPT], params)[0]
    assert len(out.token_ids) >= 5
    assert free.token_ids[0] not in out.token_ids[:4]


def test_max_tokens_finishes_with_length(llama_dir):
    out = make_engine(llama_dir).generate([PROMPT], SamplingParams(max_tokens=7, ignore_eos=True))[
        0
    ]
    assert len(out.token_ids) == 7 and out.finish_reason is FinishReason.LENGTH


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llama_dir):
    engine = make_engine(llama_dir)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True)
    alone = engine.generate([PROMPT], seeded)[0].token_ids
    other = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batched = engine.generate([PROMPT, PROMPT[:5], PROMPT[2:]], [seeded, other, other])[0].token_ids
    assert alone == batched


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding"])
def test_abort_frees_every_block(llama_dir, when):
    engine = make_engine(llama_dir, max_num_batched_tokens=4)
    total = engine.kv.num_free_blocks
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    req = engine.add_request(prompt_token_ids=PROMPT * 2, params=params)
    steps = {"waiting": 0, "mid_prefill": 2, "decoding": 9}[when]
    for _ in range(steps):
        engine.step()
    assert (req.num_output_tokens > 0) == (when == "decoding")
    out = engine.abort(req.request_id)
    assert out is not None and out.finished and out.finish_reason is FinishReason.ABORT
    assert engine.kv.num_free_blocks == total
    assert not engine.has_unfinished_requests()


def test_request_past_its_deadline_is_dropped_before_prefill(llama_dir):
    now = [100.0]
    engine = make_engine(llama_dir, clock=lambda: now[0])
    req = engine.add_request(prompt_token_ids=PROMPT, deadline=105.0)
    now[0] = 106.0
    outs = engine.step()
    assert [o.finish_reason for o in outs] == [FinishReason.DEADLINE]
    assert req.num_computed_tokens == 0 and engine.num_prompt_tokens_computed == 0


def test_stop_string_and_text_with_a_real_tokenizer(demo_dir):
    engine = make_engine(demo_dir)
    prompt = engine.tokenizer.render_chat([{"role": "user", "content": "hello"}])
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = engine.generate([prompt], greedy)[0]
    assert full.text == engine.tokenizer.decode(full.token_ids)
    stop = full.text[5:8]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    cut = engine.generate([prompt], params)[0]
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(stop)]


def test_async_engine_streams_the_same_tokens_and_cancelling_frees_blocks(llama_dir):
    engine = make_engine(llama_dir)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = engine.generate([PROMPT], greedy)[0].token_ids
    total = engine.kv.num_free_blocks
    aengine = AsyncEngine(engine)
    aengine.start()

    async def main():
        tokens = []
        async for out in aengine.generate(
            engine.make_request("a", prompt_token_ids=PROMPT, params=greedy)
        ):
            tokens += out.new_token_ids
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = aengine.generate(engine.make_request("b", prompt_token_ids=PROMPT, params=long))
        async for _ in stream:
            break  # the client goes away after its first token
        await stream.aclose()
        for _ in range(200):
            if aengine.is_idle():
                break
            await asyncio.sleep(0.01)
        return tokens

    try:
        assert asyncio.run(main()) == expected
        assert engine.kv.num_free_blocks == total
        assert not engine.has_unfinished_requests()
    finally:
        aengine.shutdown()
