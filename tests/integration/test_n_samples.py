"""n > 1: samples share the prompt's KV (computed once, the rest from the prefix cache),
each draws from its own seed stream, and usage counts the prompt once."""

import json

import httpx
import pytest

from tests.support.worker import running_worker


@pytest.fixture(scope="module")
def worker(demo_dir):
    with running_worker(demo_dir) as w:
        yield w


PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # several full KV blocks


def test_n_samples_are_distinct_and_the_prompt_is_computed_once(worker):
    engine = worker.engine
    before = engine.num_prompt_tokens_computed
    body = {
        "model": "small",
        "prompt": PROMPT,
        "n": 4,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 11,
        "ignore_eos": True,
        "cache_salt": "n-test",
    }
    r = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert len(set(texts)) == 4  # distinct seed streams
    usage = out["usage"]
    prompt_tokens = usage["prompt_tokens"]
    assert usage["completion_tokens"] == 4 * 12
    assert usage["total_tokens"] == prompt_tokens + 48
    # The prompt is computed once; each other sample recomputes at most its last partial
    # block (the last prompt token is always recomputed, DESIGN.md 3.3).
    computed = engine.num_prompt_tokens_computed - before
    block = engine.config.block_size
    assert prompt_tokens > 2 * block
    assert computed <= prompt_tokens + 3 * block
    # Same seed, same samples: each sample's stream is reproducible.
    again = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60).json()
    assert [c["text"] for c in again["choices"]] == texts


def test_n_streaming_chunks_carry_each_choice_index(worker):
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": "hello"}],
        "n": 3,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    texts: dict[int, str] = {}
    finishes, usage = {}, None
    with httpx.stream("POST", f"{worker.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
                if c["finish_reason"]:
                    finishes[c["index"]] = c["finish_reason"]
            usage = chunk.get("usage") or usage
    assert sorted(texts) == [0, 1, 2] and finishes == {0: "length", 1: "length", 2: "length"}
    assert usage["completion_tokens"] == 18


def test_n_with_the_openai_client(worker):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused")
    done = client.chat.completions.create(
        model="small",
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=5,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert len(done.choices) == 2 and done.usage.completion_tokens == 10
