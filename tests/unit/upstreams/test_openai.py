from tests.unit.upstreams.fakes import BASE, FakeGetter, FakePoster, run
from workers.api.upstreams.openai import ADAPTER

ONE = b'{"object":"list","data":[{"id":"gpt-x","object":"model","created":1,"owned_by":"o"}]}'
MANY = b'{"object":"list","data":[{"id":"a","object":"model"},{"id":"b","object":"model"}]}'


def test_ready_when_models_answer_with_no_load_figures():
    load = run(ADAPTER.probe(FakeGetter({"/v1/models": (200, ONE)}), BASE, 1.0))
    assert (load.state, load.model, load.source) == ("ready", "gpt-x", "GET /v1/models")
    figures = (load.num_running, load.num_waiting, load.kv_usage, load.slots, load.max_model_len)
    assert figures == (None,) * 5


def test_a_list_of_many_models_names_none():
    load = run(ADAPTER.probe(FakeGetter({"/v1/models": (200, MANY)}), BASE, 1.0))
    assert (load.state, load.model) == ("ready", None)


def test_not_ready_states():
    bad_key = b'{"error":{"message":"Incorrect API key provided","type":"invalid_request_error"}}'
    load = run(ADAPTER.probe(FakeGetter({"/v1/models": (401, bad_key)}), BASE, 1.0))
    assert (load.state, load.reason) == (
        "unreachable",
        "GET /v1/models: 401 Incorrect API key provided",
    )
    load = run(ADAPTER.probe(FakeGetter({"/v1/models": (503, b"")}), BASE, 1.0))
    assert load.state == "loading"
    assert run(ADAPTER.probe(FakeGetter({}, refuse=True), BASE, 1.0)).state == "unreachable"


def test_overloaded_is_429_or_503_only():
    assert ADAPTER.overloaded(429, b'{"error":{"message":"Rate limit reached"}}')
    assert ADAPTER.overloaded(503, b"")
    assert not ADAPTER.overloaded(400, b'{"error":{"message":"bad request","code":400}}')
    assert not ADAPTER.overloaded(401, b"")


def test_count_prompt_is_none():
    post = FakePoster({})
    assert run(ADAPTER.count_prompt(post, BASE, {"prompt": "Hi"}, 1.0)) is None
    assert post.sent == [] and ADAPTER.gives_logprobs is True
