"""The real default model (SmolLM2-135M-Instruct from a pinned PyPI wheel), fp32:
greedy parity with transformers, its chat template over HTTP with the openai client,
and stopping on EOS."""

import pytest
import torch
from openai import OpenAI

from tests.support.worker import running_worker
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
CHATS = [QUESTION, "Write a haiku about the sea.", "Name three prime numbers."]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def engine(real_model_dir):
    config = EngineConfig(
        num_kv_blocks=64, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)
    )
    return LLMEngine.from_pretrained(real_model_dir, config)


def prompts(engine: LLMEngine) -> list[list[int]]:
    """Chat prompts rendered by the template (no extra special tokens) and one plain text."""
    tok = engine.tokenizer
    assert tok is not None
    chats = [
        tok.encode(tok.render_chat([{"role": "user", "content": c}]), add_special_tokens=False)
        for c in CHATS
    ]
    return [*chats, tok.encode("The three primary colours are")]


def test_greedy_output_equals_transformers_including_eos_stops(real_model_dir, engine):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    eos = engine.eos_token_ids
    batch = prompts(engine)
    ours = engine.generate(batch, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    with torch.inference_mode():
        for ids, got in zip(batch, ours, strict=True):
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos
            )
            assert got.token_ids == out[0, len(ids) :].tolist()
    assert ours[0].text == ANSWER
    stopped = [c for c in ours if c.finish_reason is not None and c.finish_reason.value == "stop"]
    assert stopped and all(c.token_ids[-1] in eos for c in stopped)


def test_chat_completion_through_the_openai_client_stops_on_eos(real_model_dir):
    with running_worker(real_model_dir, num_kv_blocks=64) as worker:
        client = OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": QUESTION}]
        resp = client.chat.completions.create(
            model="small", messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        choice = resp.choices[0]
        assert choice.message.content == ANSWER
        assert choice.finish_reason == "stop"
        tok = worker.engine.tokenizer
        rendered = tok.render_chat(messages)
        assert resp.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
        assert resp.usage.completion_tokens < MAX_TOKENS

        stream = client.chat.completions.create(
            model="small", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert text == ANSWER
        assert reasons[-1] == "stop"
