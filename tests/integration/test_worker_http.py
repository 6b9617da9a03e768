"""The worker over real HTTP on loopback: parity, streaming, usage, cancellation, drain,
load shedding, stall detection, validation."""

import json
import time

import httpx
import msgspec
import pytest

from tests.support.waiting import eventually
from tests.support.worker import running_worker
from tests.support.worker_client import load
from workers.api.types import Usage
from workers.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def worker(demo_dir):
    with running_worker(demo_dir) as w:
        yield w


def sse_events(lines) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def greedy_body(**kw) -> dict:
    return {
        "model": "small",
        "prompt": "The history of",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        **kw,
    }


def test_completion_matches_the_engine_and_reports_usage(worker):
    r = httpx.post(f"{worker.url}/v1/completions", json=greedy_body(), timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    tok = worker.engine.tokenizer
    prompt_ids = tok.encode("The history of")
    # The engine's own greedy output for the same prompt (computed while the worker idles).
    ref = tok.decode(_engine_greedy(worker, prompt_ids, 12))
    assert body["choices"][0]["text"] == ref
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["total_tokens"] == len(prompt_ids) + 12
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    assert r.headers["x-request-id"] == body["id"]


def _engine_greedy(worker, prompt_ids, n):
    import asyncio

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    req = worker.engine.make_request(prompt_token_ids=prompt_ids, params=params)

    async def run():
        ids = []
        async for out in worker.service.engine.generate(req):
            ids += out.new_token_ids
        return ids

    return asyncio.run(run())


def test_streaming_equals_non_streaming_and_ends_with_usage_and_done(worker):
    full = httpx.post(f"{worker.url}/v1/completions", json=greedy_body(), timeout=30).json()
    body = greedy_body(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full["choices"][0]["text"]
    # The same counts; the engine time (`compute_seconds`) is each run's own.
    streamed_usage = {k: v for k, v in chunks[-1]["usage"].items() if k != "compute_seconds"}
    full_usage = {k: v for k, v in full["usage"].items() if k != "compute_seconds"}
    assert chunks[-1]["choices"] == [] and streamed_usage == full_usage
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def _compute_seconds(usage: dict) -> dict:
    """The usage extension, as `workers.api.types.Usage` decodes it."""
    decoded = msgspec.convert(usage, Usage).compute()
    assert decoded is not None, usage
    return {"prefill_s": decoded.prefill_s, "decode_s": decoded.decode_s}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_usage_reports_the_requests_prefill_and_decode_engine_seconds(worker, chat):
    if chat:
        path = "/v1/chat/completions"
        body = {**greedy_body(), "messages": [{"role": "user", "content": "The history of"}]}
        del body["prompt"]
    else:
        path, body = "/v1/completions", greedy_body()
    started = time.perf_counter()
    full = httpx.post(f"{worker.url}{path}", json=body, timeout=30).json()
    full_s = time.perf_counter() - started
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    with httpx.stream("POST", f"{worker.url}{path}", json=stream, timeout=30) as r:
        chunks = [json.loads(e) for e in sse_events(r.iter_lines())[:-1]]
    stream_s = time.perf_counter() - started
    assert all("usage" not in c for c in chunks[:-1])  # only the final usage chunk has it
    for usage, exchange_s in ((full["usage"], full_s), (chunks[-1]["usage"], stream_s)):
        seconds = _compute_seconds(usage)
        assert seconds["prefill_s"] > 0 and seconds["decode_s"] > 0
        assert seconds["prefill_s"] + seconds["decode_s"] < exchange_s  # alone: its steps


def test_openai_client_chat_streaming_and_not(worker):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "hello there"}]
    kw = {"model": "small", "messages": messages, "max_tokens": 10, "temperature": 0}
    done = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    streamed = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    parts, usage = [], None
    for chunk in streamed:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert done.choices[0].message.role == "assistant"
    assert "".join(parts) == done.choices[0].message.content
    assert usage.completion_tokens == done.usage.completion_tokens == 10
    models = client.models.list()
    assert {m.id for m in models.data} == {"small", "demo"}


def test_logprobs_in_chat_and_completions(worker):
    r = httpx.post(
        f"{worker.url}/v1/completions", json=greedy_body(max_tokens=3, logprobs=2)
    ).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert all(len(t) == 2 for t in lp["top_logprobs"])
    assert all(v <= 0 for v in lp["token_logprobs"])
    chat = {
        "model": "small",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = httpx.post(f"{worker.url}/v1/chat/completions", json=chat).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and len(content[0]["top_logprobs"]) == 3


def test_streaming_disconnect_aborts_and_frees_kv(worker):
    body = greedy_body(max_tokens=1500, stream=True, prompt="a long story " * 20)
    with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # kept open: closing it would close the connection
        next(line for line in lines if line.startswith("data: "))
        assert load(worker.url)["kv_blocks_used"] > 0
        assert load(worker.url)["num_running"] == 1
    # Leaving the block closes the connection mid-stream.
    assert eventually(lambda: load(worker.url)["kv_blocks_used"] == 0)
    assert load(worker.url)["num_running"] == 0


def test_non_streaming_disconnect_aborts_and_frees_kv(worker):
    body = greedy_body(max_tokens=400, prompt="a long story " * 20)
    generated = worker.engine.num_generated_tokens
    worker.stall()  # hold the request resident so the client gives up first
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{worker.url}/v1/completions", json=body, timeout=0.5)
        # The server noticed the disconnect and handed the engine an abort while the
        # request was still resident (finishing it normally would free KV too).
        assert eventually(lambda: worker.service.engine.pending_aborts() == 1)
    finally:
        worker.unstall()
    assert eventually(lambda: load(worker.url)["kv_blocks_used"] == 0)
    assert eventually(
        lambda: load(worker.url)["num_running"] == 0 and load(worker.url)["num_waiting"] == 0
    )
    # Aborted at the first step boundary: the held step's token at most, not 400.
    assert worker.engine.num_generated_tokens - generated <= 1


@pytest.mark.parametrize(
    ("patch", "status", "param"),
    [
        ({"max_tokens": "many"}, 400, "max_tokens"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"temperature": 7}, 400, "temperature"),
        ({"top_p": 1.5}, 400, "top_p"),
        ({"stop": [""]}, 400, "stop"),
        ({"model": "nope"}, 404, "model"),
        ({"max_tokens": 5000}, 400, "max_tokens"),
        ({"n": 17}, 400, "n"),
        ({"prompt": 12}, 400, "prompt"),
    ],
)
def test_invalid_requests_get_openai_shaped_errors(worker, patch, status, param):
    r = httpx.post(f"{worker.url}/v1/completions", json=greedy_body(**patch))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_malformed_json_and_missing_fields_are_400(worker):
    r = httpx.post(
        f"{worker.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{worker.url}/v1/chat/completions", json={"model": "small"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_prompt_far_beyond_context_is_refused_without_tokenizing(worker):
    huge = "x" * 5_000_000
    t0 = time.perf_counter()
    r = httpx.post(f"{worker.url}/v1/completions", json=greedy_body(prompt=huge), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert time.perf_counter() - t0 < 2.0


def test_metrics_expose_vllm_style_names(worker):
    httpx.post(f"{worker.url}/v1/completions", json=greedy_body(max_tokens=2))
    text = httpx.get(f"{worker.url}/metrics").text
    for name in (
        "switchyard_worker_num_requests_running",
        "switchyard_worker_kv_cache_usage_perc",
        "switchyard_worker_prefix_cache_hits_total",
        "switchyard_worker_generation_tokens_total",
        "switchyard_worker_time_to_first_token_seconds_bucket",
        'switchyard_worker_request_success_total{finished_reason="length"',
    ):
        assert name in text, name


def test_metrics_answer_the_inference_gateway_protocol_as_load_does(worker):
    """The vLLM names an Inference Extension endpoint picker scrapes, read while one request
    runs and a second is handed in behind an engine held inside its third step: they parse,
    carry `model_name`, and say what /load says, the arrival waiting included."""
    import threading

    from prometheus_client.parser import text_string_to_metric_families

    runner = worker.engine.runner
    original = runner.execute
    blocked, release = threading.Event(), threading.Event()
    calls = 0

    def third_step_blocks(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:  # after a prefill and a decode: running, its KV blocks held
            runner.execute = original
            blocked.set()
            release.wait(30)
        return original(*args, **kwargs)

    runner.execute = third_step_blocks
    try:
        first = _send_async(worker.url, greedy_body(max_tokens=16))
        assert blocked.wait(10)
        second = _send_async(worker.url, greedy_body(max_tokens=2))
        assert eventually(lambda: load(worker.url)["num_waiting"] == 1)
        report = load(worker.url)
        families = {
            f.name: f
            for f in text_string_to_metric_families(httpx.get(f"{worker.url}/metrics").text)
        }
        after = load(worker.url)  # the engine is held: one snapshot throughout
        engine_fields = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total")
        assert all(after[k] == report[k] for k in engine_fields)
    finally:
        runner.execute = original
        release.set()
    first.join(30)
    second.join(30)

    def value(name: str) -> float:
        assert families[name].type == "gauge", name
        [sample] = families[name].samples
        assert sample.labels == {"model_name": "small"}, name
        return sample.value

    assert report["num_running"] == 1 and report["kv_blocks_used"] >= 1
    assert value("vllm:num_requests_waiting") == report["num_waiting"] == 1
    assert value("vllm:num_requests_running") == report["num_running"]
    kv = report["kv_blocks_used"] / report["kv_blocks_total"]
    assert value("vllm:kv_cache_usage_perc") == value("vllm:gpu_cache_usage_perc") == kv
    [info] = families["vllm:cache_config_info"].samples
    assert info.value == 1
    assert info.labels["num_gpu_blocks"] == str(report["kv_blocks_total"])
    block_size = report["kv_total_tokens"] // report["kv_blocks_total"]
    assert info.labels["block_size"] == str(block_size) == "16"
    assert "vllm:lora_requests_info" not in families  # no adapters served: see metrics.py


def test_full_waiting_line_gets_503_with_jittered_retry_after(demo_dir):
    # One seat: the second request cannot be admitted soon, so it fills the line.
    with running_worker(demo_dir, max_num_seqs=1, max_waiting_requests=1, stall_timeout_s=60) as w:
        w.stall()
        blocker = httpx.AsyncClient  # noqa: F841 (documentation: requests below stay resident)
        with httpx.Client(base_url=w.url, timeout=10) as c:
            first = _send_async(w.url, greedy_body(stream=True))
            assert eventually(lambda: load(w.url)["num_running"] + load(w.url)["num_waiting"] >= 1)
            second = _send_async(w.url, greedy_body(stream=True))
            assert eventually(lambda: load(w.url)["num_waiting"] >= 1)
            refusals = [c.post("/v1/completions", json=greedy_body()) for _ in range(8)]
        assert all(r.status_code == 503 for r in refusals)
        assert all(r.json()["error"]["code"] == "server_overloaded" for r in refusals)
        waits = {r.headers["retry-after-ms"] for r in refusals}
        assert all(int(r.headers["retry-after"]) >= 1 for r in refusals) and len(waits) > 1
        w.unstall()
        first.join(10)
        second.join(10)


def test_burst_that_fits_the_batch_and_kv_is_never_refused(demo_dir):
    # The default shape: 64 seats, a line of 32. All 64 arrive while the engine is stuck
    # in a step; the ones waiting for a seat that is free do not count against the line.
    with running_worker(
        demo_dir, max_num_seqs=64, max_waiting_requests=32, stall_timeout_s=60
    ) as w:
        w.stall()
        statuses: list[int] = []

        def one() -> None:
            body = greedy_body(stream=True, max_tokens=4)
            with httpx.stream("POST", f"{w.url}/v1/completions", json=body, timeout=60) as r:
                statuses.append(r.status_code)
                r.read()

        import threading

        threads = [threading.Thread(target=one, daemon=True) for _ in range(64)]
        for t in threads:
            t.start()
        assert eventually(
            lambda: (
                (lambda s: s["num_running"] + s["num_waiting"])(load(w.url)) >= 64
                or len(statuses) == 64
            ),
            timeout_s=20,
        )
        w.unstall()
        for t in threads:
            t.join(60)
        assert sorted(statuses) == [200] * 64


def _send_async(url: str, body: dict):
    import threading

    t = threading.Thread(
        target=lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=30), daemon=True
    )
    t.start()
    return t


def test_ready_turns_503_when_the_engine_loop_stalls(demo_dir):
    with running_worker(demo_dir, stall_timeout_s=0.5) as w:
        assert httpx.get(f"{w.url}/ready").status_code == 200
        w.stall()
        t = _send_async(w.url, greedy_body())
        assert eventually(lambda: httpx.get(f"{w.url}/ready").status_code == 503, timeout_s=3)
        assert load(w.url)["state"] == "stalled"
        assert httpx.get(f"{w.url}/health").status_code == 200  # the port still answers
        w.unstall()
        assert eventually(lambda: httpx.get(f"{w.url}/ready").status_code == 200)
        t.join(10)


def test_a_step_that_is_slow_but_computing_is_not_a_stall(demo_dir):
    """The engine thread spends 4 stall timeouts inside one step, using CPU all along (as
    a step does when several engines share the cores): the worker stays ready, and says
    so in /ready and /load throughout; the request then completes."""
    import threading

    with running_worker(demo_dir, stall_timeout_s=0.5) as w:
        runner = w.engine.runner
        original = runner.execute
        spinning, stop = threading.Event(), threading.Event()

        def slow(*args, **kwargs):
            runner.execute = original
            spinning.set()
            n = 0
            while not stop.is_set():  # pure computation on the engine thread
                n += 1
            return original(*args, **kwargs)

        runner.execute = slow
        try:
            t = _send_async(w.url, greedy_body())
            assert spinning.wait(10)
            states: set[str] = set()
            while time.monotonic() - w.service.engine.heartbeat[0] < 2.0:  # 4 timeouts
                states.add(load(w.url)["state"])
                assert httpx.get(f"{w.url}/ready").status_code == 200
        finally:
            stop.set()
        assert states == {"ready"}
        t.join(10)
        assert load(w.url)["state"] == "ready"


def test_drain_refuses_new_work_finishes_resident_and_exits(demo_dir):
    with running_worker(demo_dir) as w:
        body = greedy_body(max_tokens=60, stream=True)
        with httpx.stream("POST", f"{w.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            d = httpx.post(f"{w.url}/drain", json={"exit_when_empty": False})
            assert d.json()["state"] == "draining"
            refused = httpx.post(f"{w.url}/v1/completions", json=greedy_body())
            assert refused.status_code == 503 and "retry-after" in refused.headers
            assert httpx.get(f"{w.url}/ready").status_code == 503
            rest = sse_events(lines)
        assert rest[-1] == "[DONE]"
        assert load(w.url)["state"] == "draining"
