import pytest

from tests.unit.upstreams.fakes import BASE, FakeGetter, FakePoster, fixture, run
from workers.api.upstreams.sglang import ADAPTER


def routes(metrics: str | None = "metrics.txt") -> dict[str, tuple[int | None, bytes]]:
    r: dict[str, tuple[int | None, bytes]] = {
        "/health": (200, b""),
        "/v1/models": (200, fixture("sglang", "v1_models.json")),
        "/get_load": (200, fixture("sglang", "get_load.json")),
    }
    if metrics:
        r["/metrics"] = (200, fixture("sglang", metrics))
    return r


@pytest.mark.parametrize("metrics", ["metrics.txt", "metrics_underscore.txt"])
def test_probe_reads_metrics_of_either_prefix(metrics):
    getter = FakeGetter(routes(metrics))
    load = run(ADAPTER.probe(getter, BASE, 1.0))
    assert load.state == "ready"
    assert (load.num_running, load.num_waiting) == (7, 3)
    assert load.kv_usage == pytest.approx(0.31)
    assert (load.max_model_len, load.model) == (32768, "Qwen/Qwen2.5-7B-Instruct")
    assert "/get_load" not in getter.asked  # deprecated: only read without /metrics


def test_probe_falls_back_to_get_load_summed_over_dp_ranks():
    load = run(ADAPTER.probe(FakeGetter(routes(None)), BASE, 1.0))
    # ranks: num_reqs 9 and 4 (running + waiting), num_waiting_reqs 2 and 1
    assert (load.num_running, load.num_waiting) == (10, 3)
    assert load.kv_usage is None  # only /metrics has token_usage
    assert load.source == "GET /health, GET /v1/models, GET /get_load"


def test_no_metrics_and_no_get_load_leave_figures_unknown():
    r = routes(None)
    del r["/get_load"]
    load = run(ADAPTER.probe(FakeGetter(r), BASE, 1.0))
    assert (load.state, load.num_running, load.num_waiting) == ("ready", None, None)


def test_warm_up_503_is_loading_and_refused_is_unreachable():
    r = routes()
    r["/health"] = (503, b"")
    assert run(ADAPTER.probe(FakeGetter(r), BASE, 1.0)).state == "loading"
    assert run(ADAPTER.probe(FakeGetter({}, refuse=True), BASE, 1.0)).state == "unreachable"


@pytest.mark.parametrize(
    ("status", "body", "busy"),
    [
        (503, b"", True),
        (429, b"", True),
        (400, b'{"object":"error","message":"bad","type":"BadRequestError","code":400}', False),
        (200, fixture("sglang", "sse_error_value.txt"), False),  # a ValueError, no code
    ],
)
def test_overloaded(status, body, busy):
    assert ADAPTER.overloaded(status, body) is busy


def test_count_prompt_is_none_without_a_sourced_endpoint():
    post = FakePoster({})
    assert run(ADAPTER.count_prompt(post, BASE, {"prompt": "Hi"}, 1.0)) is None
    assert post.sent == []
