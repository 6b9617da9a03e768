"""logit_bias, end to end: the engine's greedy output with a bias equals transformers' with the
same bias applied as a logits processor (batched beside unbiased requests, which keep their
own output); over HTTP a worker serves it, and refuses (400 naming it) a bias it cannot honour;
a gateway refuses the same before any worker sees it, and passes a good one through."""

import random

import httpx
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tests.support.checkpoints import VOCAB, load_reference, reference_greedy
from tests.support.gateway import gateway_in_front
from tests.support.waiting import eventually
from tests.support.worker import running_worker
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.server import app as worker_app

MAX_TOKENS = 12


class AddBias(LogitsProcessor):
    """transformers' side: `bias` added to the scores of its tokens at every step."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.ids] += self.values
        return scores


def reference_biased(model, prompt: list[int], bias: dict[int, float]) -> list[int]:  # noqa: ANN001
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([AddBias(bias)]),
        )
    return out[0, len(prompt) :].tolist()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def bias_against(unbiased: list[int], seed: int) -> dict[int, float]:
    """A bias that changes the greedy output: the third token banned, two others nudged."""
    rng = random.Random(seed)
    return {unbiased[2]: -100.0, rng.randrange(3, VOCAB): 6.5, rng.randrange(3, VOCAB): -3.25}


def greedy(bias: dict[int, float] | None = None) -> SamplingParams:
    # min_tokens = max_tokens masks EOS throughout, as transformers' min_new_tokens does.
    return SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, logit_bias=bias or {}
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_a_logit_bias_matches_transformers_with_it_as_a_logits_processor(
    arch, checkpoints
):
    reference = load_reference(checkpoints[arch])
    engine = LLMEngine.from_pretrained(
        checkpoints[arch],
        EngineConfig(num_kv_blocks=128, block_size=4, scheduler=SchedulerConfig()),
    )
    batch = prompts(4, seed=5)
    unbiased = [reference_greedy(reference, p, MAX_TOKENS) for p in batch]
    # Rows 0 and 2 biased (each its own bias), rows 1 and 3 not, all in the same batches.
    biases = [bias_against(unbiased[0], 0), None, bias_against(unbiased[2], 2), None]
    results = engine.generate(batch, [greedy(b) for b in biases])
    for prompt, bias, plain, result in zip(batch, biases, unbiased, results, strict=True):
        if bias is None:
            assert result.token_ids == plain
        else:
            expected = reference_biased(reference, prompt, bias)
            assert expected != plain  # the bias changes the output...
            assert result.token_ids == expected  # ...exactly as transformers applies it


@pytest.fixture(scope="module")
def tiny_worker(llama_dir):
    with running_worker(llama_dir) as w:
        yield w


def _complete(url: str, prompt: list[int], **kw) -> httpx.Response:
    body = {"model": "small", "prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS}
    return httpx.post(f"{url}/v1/completions", json={**body, **kw}, timeout=60)


def test_a_worker_serves_a_logit_bias_as_transformers_applies_it(tiny_worker, llama_dir):
    reference = load_reference(llama_dir)
    prompt = prompts(1, seed=9)[0]
    bias = bias_against(reference_greedy(reference, prompt, MAX_TOKENS), 9)
    wire = {str(t): v for t, v in bias.items()}  # JSON object keys are strings
    r = _complete(tiny_worker.url, prompt, temperature=0, logprobs=0, logit_bias=wire)
    assert r.status_code == 200, r.text
    # No tokenizer: each token's text is its id.
    tokens = [int(t) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    assert tokens == reference_biased(reference, prompt, bias)


def test_a_plus_100_bias_decides_every_sampled_token(tiny_worker):
    r = _complete(tiny_worker.url, [5, 6, 7], temperature=1.0, seed=4, logprobs=0,
                  logit_bias={"17": 100})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["17"] * MAX_TOKENS


@pytest.mark.parametrize(
    "bias",
    [{str(VOCAB): 1}, {"-1": 1}, {"5": 100.5}, {"5": -101}, {str(i): 1 for i in range(301)},
     {"x": 1}, {"5": "1"}],
    ids=["id-beyond-vocab", "negative-id", "over-100", "under-minus-100", "too-many",
         "word-key", "string-value"],
)  # fmt: skip
def test_a_bad_logit_bias_is_a_400_naming_it_and_never_reaches_the_engine(tiny_worker, bias):
    before = tiny_worker.engine.num_prompt_tokens_computed
    r = _complete(tiny_worker.url, [5, 6, 7], logit_bias=bias)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["type"]) == ("logit_bias", "invalid_request_error")
    assert tiny_worker.engine.num_prompt_tokens_computed == before
    assert _complete(tiny_worker.url, [5, 6, 7]).status_code == 200  # still serving


@pytest.fixture(scope="module")
def demo_worker(demo_dir):
    with running_worker(demo_dir) as w:
        yield w


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "suffix", "x"),
        ("/v1/completions", "best_of", 3),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/chat/completions", "store", True),
    ],
)
def test_a_worker_refuses_an_openai_field_it_does_not_implement(demo_worker, path, field, value):
    body = {"model": "small", "max_tokens": 2, field: value}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r = httpx.post(f"{demo_worker.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (field, "unknown_field")


def test_a_gateway_refuses_a_bad_logit_bias_itself_and_passes_a_good_one(demo_worker, monkeypatch):
    worker = demo_worker
    seen: list[bytes] = []
    decode = worker_app._decode

    def counting(service, raw, kind):  # noqa: ANN001, ANN202
        seen.append(raw)
        return decode(service, raw, kind)

    monkeypatch.setattr(worker_app, "_decode", counting)
    with gateway_in_front({"small": [worker.url]}, load_poll_interval_s=0.05) as front:
        pool = front.gateway.pools["small"]
        # The gateway learns the vocabulary from its first load poll.
        assert eventually(lambda: pool.model_limits()[0] is not None)
        vocab = pool.model_limits()[0]
        assert vocab == worker.service.vocab_size
        client = front.client()
        body = {"model": "small", "prompt": "The quick brown fox", "max_tokens": 8,
                "temperature": 0}  # fmt: skip
        for bad in ({str(vocab): 1}, {"5": 250}, {str(i): 1 for i in range(301)}):
            r = client.post("/v1/completions", json={**body, "logit_bias": bad})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "logit_bias"
        r = client.post("/v1/completions", json={**body, "suffix": "!"})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "suffix")
        assert seen == []  # the worker never saw any of them
        plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        good = {**body, "logit_bias": {"300": 100}}
        via_gateway = client.post("/v1/completions", json=good)
        assert via_gateway.status_code == 200, via_gateway.text
        direct = httpx.post(f"{worker.url}/v1/completions", json=good, timeout=60)
        text = via_gateway.json()["choices"][0]["text"]
        assert text == direct.json()["choices"][0]["text"] != plain
        assert b'"logit_bias"' in seen[-2]  # the gateway sent it on
