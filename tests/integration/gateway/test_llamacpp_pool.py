"""A real llama-server as a pool behind the gateway, through the official `openai` client:
chat and completions, streams with usage, the quota charged what the client is told, `auto`
cascading between a Switchyard-shaped pool and llama-server, overflow, a server loading
(503) kept out of the rotation, one killed mid-stream, and a burst beyond its slots refused
with Retry-After rather than queued without bound.

The small pool is the fake backend (the part not under test); llama-server is real (the
cached build, on the default model's GGUF)."""

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.config import UpstreamConfig
from tests.integration.gateway.conftest import gateway_stack
from tests.support.llama_server import RunningLlamaServer, health_status, running_llama_server
from tests.support.waiting import eventually

SLOTS = 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningLlamaServer]:
    with running_llama_server(tmp_path_factory.mktemp("llama"), num_slots=SLOTS) as s:
        yield s


def _stack(redis_url: str, urls: list[str], **config):
    """small: a fake Switchyard worker; large: the llama-server(s) at `urls`."""
    up = {"large": UpstreamConfig(kind="llamacpp", model="smollm2")}
    return gateway_stack(
        redis_url,
        replicas={"small": 1},
        upstreams=up,
        extra_pools={"large": urls},
        cascade_small_pool="small",
        cascade_large_pool="large",
        **config,
    )


def _ready(s, pool: str = "large") -> bool:
    views = list(s.gateway.pools[pool].views.values())
    return bool(views) and all(v.state == "ready" for v in views)


def _client(s, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_chat_completions_and_streams_through_the_gateway_charge_what_they_tell(redis_url, llama):
    with _stack(redis_url, [llama.base_url]) as s:
        assert eventually(lambda: _ready(s), 10)
        view = next(iter(s.gateway.pools["large"].views.values()))
        assert (view.kind, view.seats, view.max_model_len) == ("llamacpp", SLOTS, 512)
        client = _client(s, s.tenant("acme"))
        chat = client.chat.completions.create(
            model="large",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0,
        )
        assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8
        text = client.completions.create(
            model="large", prompt="The capital of France is", max_tokens=6, temperature=0
        )
        assert "Paris" in text.choices[0].text and text.usage.completion_tokens == 6
        stream = client.chat.completions.create(
            model="large",
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 10
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        told = chat.usage.total_tokens + text.usage.total_tokens + usage.total_tokens
        assert eventually(lambda: s.charged("acme") == told)
        # A stream whose client did not ask for usage: none reaches it, yet it is charged.
        quiet = list(
            client.completions.create(
                model="large", prompt="Hello", max_tokens=4, temperature=0, stream=True
            )
        )
        assert all(c.usage is None for c in quiet)
        assert eventually(lambda: s.charged("acme") > told)


def test_a_prompt_estimated_near_the_context_limit_is_counted_by_the_server(redis_url, llama):
    # ~1,000 bytes of English: estimated at 3 bytes a token (334), more than the 312 the
    # 512-token context leaves beside 200 output tokens; llama-server counts about 200.
    prompt = ("The quick brown fox jumps over the lazy dog while the sun sets. " * 16)[:1000]
    with _stack(redis_url, [llama.base_url]) as s:
        assert eventually(lambda: _ready(s), 10)
        client = _client(s, s.tenant("count"))
        r = client.completions.create(model="large", prompt=prompt, max_tokens=200)
        assert r.usage.prompt_tokens < 312 < -(-len(prompt) // 3)
        with pytest.raises(openai.BadRequestError) as err:  # and what does not fit is refused
            client.completions.create(model="large", prompt=prompt * 2, max_tokens=200)
        assert err.value.code == "context_length_exceeded"


def test_auto_cascades_across_engines_and_overflows_to_small_when_large_is_full(redis_url, llama):
    with _stack(redis_url, [llama.base_url], max_inflight_per_worker=8) as s:
        assert eventually(lambda: _ready(s), 10)
        key = s.tenant("auto")
        with s.admin() as a:
            a.put("/admin/routing", json={"default_threshold": 0.0, "overflow_max_wait_s": 0.2})
        client = _client(s, key)
        hard = client.with_options(max_retries=0).completions.with_raw_response.create(
            model="auto", prompt="Prove that there are infinitely many primes.", max_tokens=4
        )
        assert hard.headers["x-switchyard-model"] == "large"  # threshold 0: all to large
        assert hard.headers["x-switchyard-route"] == "classifier"
        # Fill llama-server's slots (the pool's seats) with long answers and one more that
        # waits: the next `auto` request overflows to the small pool instead of waiting.
        body = {"model": "large", "prompt": "Tell me a long story.", "max_tokens": 200}
        # Long for sure: the model's end-of-generation tokens (0, 2, 4) banned, since
        # ignore_eos is the operator's field (a sampled story once ended after 7 tokens and
        # freed its slot before the queue formed).
        body["logit_bias"] = {"0": -100, "2": -100, "4": -100}
        fillers = [
            threading.Thread(
                target=httpx.post,
                args=(f"{s.url}/v1/completions",),
                kwargs={"json": body, "headers": {"authorization": f"Bearer {key}"}, "timeout": 60},
            )
            for _ in range(SLOTS + 1)
        ]
        for t in fillers:
            t.start()
        pool = s.gateway.pools["large"]
        assert eventually(lambda: sum(v.inflight for v in pool.views.values()) == SLOTS)
        assert eventually(lambda: len(pool.queue) == 1)
        over = client.completions.with_raw_response.create(
            model="auto", prompt="Prove that there are infinitely many primes.", max_tokens=4
        )
        assert (over.headers["x-switchyard-model"], over.headers["x-switchyard-route"]) == (
            "small",
            "overflow",
        )
        for t in fillers:
            t.join()


def test_a_loading_server_is_kept_out_and_a_killed_one_ends_its_stream_in_band(redis_url, tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)  # a model file nobody writes: the server stays loading (503)
    with (
        running_llama_server(tmp_path / "a", gguf=fifo, wait=False) as loading,
        running_llama_server(tmp_path / "b", num_slots=SLOTS) as good,
    ):
        assert eventually(lambda: health_status(loading) == 503, 30)
        with _stack(redis_url, [loading.base_url, good.base_url]) as s:
            pool = s.gateway.pools["large"]
            assert eventually(lambda: pool.views[good.base_url].state == "ready", 10)
            assert pool.views[loading.base_url].state == "loading"
            key = s.tenant("kill")
            client = _client(s, key)
            for _ in range(4):  # every one served by the ready server, none sent to loading
                r = client.completions.create(model="large", prompt="Hi", max_tokens=2)
                assert r.usage.completion_tokens == 2
            assert pool.views[loading.base_url].inflight == 0
            charged = s.charged("kill")
            stream = client.completions.create(
                model="large",
                prompt="Once upon a time, in a land far away, there lived a dragon who",
                max_tokens=400,
                temperature=0,
                stream=True,
            )
            received, error = 0, None
            try:
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        received += 1
                        if received == 1:
                            os.kill(good.pid, signal.SIGKILL)
                    error = error or (chunk.model_extra or {}).get("error")
            except openai.APIError as exc:  # the client's legacy stream mode raises it
                error = exc.body
            # The in-band error event, in the OpenAI shape, then the end of the stream.
            assert error is not None and error["code"] == "upstream_failed", (error, received)
            assert "mid-stream" in error["message"]
            # Charged the prompt and what was relayed: the tokens received at least, far
            # under the 400 asked.
            assert eventually(lambda: s.charged("kill") >= charged + received)
            assert s.charged("kill") - charged < 400


def test_a_burst_beyond_its_slots_is_refused_with_retry_after_not_queued(redis_url, llama):
    target_s = 1.5
    with _stack(redis_url, [llama.base_url], ttft_target_s={"large": target_s}) as s:
        assert eventually(lambda: _ready(s), 10)
        key = s.tenant("burst", max_concurrent=64)
        results: list[tuple[int, float | None, str | None]] = []
        lock = threading.Lock()

        def one() -> None:
            body = {"model": "large", "prompt": "Tell me about the sea.", "max_tokens": 48}
            body["stream"] = True
            headers = {"authorization": f"Bearer {key}"}
            started = time.monotonic()
            first = None
            with httpx.stream(
                "POST", f"{s.url}/v1/completions", json=body, headers=headers, timeout=60
            ) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {") and '"choices"' in line:
                        first = time.monotonic() - started
                retry = r.headers.get("retry-after")
                with lock:
                    results.append((r.status_code, first, retry))

        threads = [threading.Thread(target=one) for _ in range(6 * SLOTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        served = [first for status, first, _ in results if status == 200]
        refused = [(status, retry) for status, _, retry in results if status != 200]
        assert served and refused, results
        assert all(status == 503 and retry for status, retry in refused), refused
        # What was accepted started within its target (a little slack for this busy test
        # machine's relay), not behind the whole burst in llama-server's queue.
        assert all(first is not None and first <= target_s + 0.5 for first in served), served
