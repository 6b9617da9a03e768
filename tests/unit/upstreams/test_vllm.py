import json

import pytest

from tests.unit.upstreams.fakes import BASE, FakeGetter, FakePoster, fixture, run
from workers.api.client import UpstreamError
from workers.api.upstreams.vllm import ADAPTER


def routes(metrics: str = "metrics.txt") -> dict[str, tuple[int | None, bytes]]:
    return {
        "/health": (200, b""),
        "/metrics": (200, fixture("vllm", metrics)),
        "/v1/models": (200, fixture("vllm", "v1_models.json")),
    }


def test_probe_sums_running_and_waiting_over_engines_and_averages_kv():
    load = run(ADAPTER.probe(FakeGetter(routes()), BASE, 1.0))
    assert load.state == "ready"
    assert (load.num_running, load.num_waiting) == (8, 3)  # engines 0 and 1: 5+3, 2+1
    assert load.kv_usage == pytest.approx(0.5)  # mean of 0.25 and 0.75, not their sum
    assert load.max_model_len == 32768
    assert load.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert load.slots is None
    assert load.source == "GET /health, GET /metrics, GET /v1/models"


def test_probe_reads_the_older_gpu_cache_usage_name():
    load = run(ADAPTER.probe(FakeGetter(routes("metrics_v0.txt")), BASE, 1.0))
    assert (load.num_running, load.num_waiting, load.kv_usage) == (4, 6, 0.5)


def test_figures_without_metrics_stay_unknown_not_zero():
    r = routes()
    r["/metrics"] = (404, b"")
    load = run(ADAPTER.probe(FakeGetter(r), BASE, 1.0))
    assert load.state == "ready"
    assert (load.num_running, load.num_waiting, load.kv_usage) == (None, None, None)
    assert load.max_model_len == 32768
    assert "/metrics" not in load.source


def test_refused_connection_while_loading_is_unreachable():
    load = run(ADAPTER.probe(FakeGetter({}, refuse=True), BASE, 1.0))
    assert load.state == "unreachable"
    assert load.reason == "GET /health: no answer"
    assert load.num_running is None


def test_health_503_is_loading_with_its_reason():
    r = routes()
    r["/health"] = (503, b"")
    load = run(ADAPTER.probe(FakeGetter(r), BASE, 1.0))
    assert (load.state, load.reason) == ("loading", "GET /health: 503")


def test_garbage_metrics_read_as_unknown():
    r = routes()
    r["/metrics"] = (200, b"vllm:num_requests_running{ 12 nonsense")
    load = run(ADAPTER.probe(FakeGetter(r), BASE, 1.0))
    assert load.state == "ready" and load.num_running is None


@pytest.mark.parametrize(
    ("status", "name", "busy"),
    [
        (503, "error_503.json", True),
        (429, "error_503.json", True),
        (400, "error_400.json", False),
        (500, "error_503.json", False),
        (200, "sse_error_503.txt", True),
        (200, "sse_error_400.txt", False),
        (200, "sse_first_chunk.txt", False),
    ],
)
def test_overloaded(status, name, busy):
    assert ADAPTER.overloaded(status, fixture("vllm", name)) is busy


def test_count_prompt_sends_messages_with_model_and_tools():
    post = FakePoster({"/tokenize": (200, json.loads(fixture("vllm", "tokenize.json")))})
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello, world"}], "tools": []}
    assert run(ADAPTER.count_prompt(post, BASE, body, 1.0)) == 5
    assert post.sent == [("/tokenize", {"model": "m", "messages": body["messages"], "tools": []})]


def test_count_prompt_sends_a_plain_prompt():
    post = FakePoster({"/tokenize": (200, {"count": 3, "max_model_len": 8, "tokens": [1, 2, 3]})})
    assert run(ADAPTER.count_prompt(post, BASE, {"model": "m", "prompt": "Hi there"}, 1.0)) == 3
    assert post.sent == [("/tokenize", {"model": "m", "prompt": "Hi there"})]


def test_count_prompt_of_token_ids_needs_no_request():
    post = FakePoster({})
    assert run(ADAPTER.count_prompt(post, BASE, {"prompt": [5, 6, 7]}, 1.0)) == 3
    assert post.sent == []


@pytest.mark.parametrize(
    "poster",
    [
        FakePoster({"/tokenize": (400, {"error": {"code": 400}})}),
        FakePoster({}, raises=UpstreamError("reset")),
        FakePoster({"/tokenize": (200, {"count": 10**9})}),  # more than the prompt could be
        FakePoster({"/tokenize": (200, {"count": -1})}),
    ],
)
def test_count_prompt_is_none_when_the_server_cannot_say(poster):
    assert run(ADAPTER.count_prompt(poster, BASE, {"prompt": "Hi"}, 1.0)) is None


def test_gives_logprobs():
    assert ADAPTER.gives_logprobs is True and ADAPTER.kind == "vllm"
