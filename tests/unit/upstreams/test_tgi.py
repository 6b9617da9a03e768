import json

import pytest

from tests.unit.upstreams.fakes import BASE, FakeGetter, FakePoster, fixture, run
from workers.api.upstreams.tgi import ADAPTER


def routes() -> dict[str, tuple[int | None, bytes]]:
    return {
        "/health": (200, b""),
        "/info": (200, fixture("tgi", "info.json")),
        "/metrics": (200, fixture("tgi", "metrics.txt")),
    }


def test_probe_reads_queue_batch_and_info():
    load = run(ADAPTER.probe(FakeGetter(routes()), BASE, 1.0))
    assert load.state == "ready"
    assert (load.num_running, load.num_waiting) == (12, 6)
    assert load.max_model_len == 1024  # max_input_tokens, not max_total_tokens (2048)
    assert load.model == "bigscience/blomm-560m"
    assert (load.kv_usage, load.slots) == (None, None)  # TGI reports neither
    assert load.source == "GET /health, GET /info, GET /metrics"


def test_missing_metrics_leave_queue_figures_unknown():
    r = routes()
    r["/metrics"] = (404, b"")
    load = run(ADAPTER.probe(FakeGetter(r), BASE, 1.0))
    assert (load.num_running, load.num_waiting, load.max_model_len) == (None, None, 1024)


def test_unhealthy_503_is_loading_and_refused_is_unreachable():
    r = routes()
    r["/health"] = (503, fixture("tgi", "health_503.json"))
    load = run(ADAPTER.probe(FakeGetter(r), BASE, 1.0))
    assert (load.state, load.reason) == ("loading", "GET /health: 503 unhealthy")
    assert run(ADAPTER.probe(FakeGetter({}, refuse=True), BASE, 1.0)).state == "unreachable"


@pytest.mark.parametrize(
    ("status", "name", "busy"),
    [
        (429, "overloaded_429.json", True),
        (422, "validation_422.json", False),
        (200, "sse_error_overloaded.txt", True),
        (200, "sse_error_validation.txt", False),
    ],
)
def test_overloaded(status, name, busy):
    assert ADAPTER.overloaded(status, fixture("tgi", name)) is busy


def test_count_prompt_of_messages_uses_chat_tokenize():
    answer = json.loads(fixture("tgi", "chat_tokenize.json"))
    post = FakePoster({"/chat_tokenize": (200, answer)})
    body = {"model": "tgi", "messages": [{"role": "user", "content": "Hi"}]}
    assert run(ADAPTER.count_prompt(post, BASE, body, 1.0)) == 3
    assert post.sent == [("/chat_tokenize", {"messages": body["messages"], "model": "tgi"})]


def test_count_prompt_of_a_prompt_uses_tokenize_inputs():
    post = FakePoster({"/tokenize": (200, json.loads(fixture("tgi", "tokenize.json")))})
    assert run(ADAPTER.count_prompt(post, BASE, {"prompt": "testing"}, 1.0)) == 2
    assert post.sent == [("/tokenize", {"inputs": "testing"})]


def test_count_prompt_is_none_on_404_no_tokenizer():
    post = FakePoster({"/tokenize": (404, {"error": "No fast tokenizer available"})})
    assert run(ADAPTER.count_prompt(post, BASE, {"prompt": "x"}, 1.0)) is None
