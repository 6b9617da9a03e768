import pytest

from tests.unit.upstreams.fakes import BASE, FakeGetter, FakePoster, fixture, run
from workers.api.upstreams.ollama import ADAPTER


def routes(ps: str = "ps.json") -> dict[str, tuple[int | None, bytes]]:
    return {
        "/api/version": (200, fixture("ollama", "version.json")),
        "/api/ps": (200, fixture("ollama", ps)),
    }


def test_probe_reads_the_loaded_model_and_its_context_and_no_queue_figures():
    load = run(ADAPTER.probe(FakeGetter(routes()), BASE, 1.0))
    assert load.state == "ready"
    assert (load.model, load.max_model_len) == ("gemma4", 4096)
    assert (load.num_running, load.num_waiting, load.kv_usage, load.slots) == (None,) * 4
    assert load.source == "GET /api/version, GET /api/ps"


def test_nothing_loaded_yet_is_still_ready():  # Ollama loads lazily
    load = run(ADAPTER.probe(FakeGetter(routes("ps_empty.json")), BASE, 1.0))
    assert (load.state, load.model, load.max_model_len) == ("ready", None, None)


def test_an_older_ps_without_context_length_leaves_it_unknown():
    load = run(ADAPTER.probe(FakeGetter(routes("ps_old.json")), BASE, 1.0))
    assert (load.model, load.max_model_len) == ("mistral:latest", None)


def test_several_loaded_models_name_none_and_take_the_smallest_context():
    ps = b'{"models":[{"model":"a","context_length":8192},{"model":"b","context_length":4096}]}'
    r = routes()
    r["/api/ps"] = (200, ps)
    load = run(ADAPTER.probe(FakeGetter(r), BASE, 1.0))
    assert (load.model, load.max_model_len) == (None, 4096)


def test_refused_is_unreachable():
    load = run(ADAPTER.probe(FakeGetter({}, refuse=True), BASE, 1.0))
    assert (load.state, load.reason) == ("unreachable", "GET /api/version: no answer")


@pytest.mark.parametrize(
    ("status", "name", "busy"),
    [
        (503, "busy_503.json", True),
        (503, "busy_503_openai.json", True),
        (404, "not_found_404_openai.json", False),
    ],
)
def test_overloaded(status, name, busy):
    assert ADAPTER.overloaded(status, fixture("ollama", name)) is busy


def test_no_prompt_counting_and_no_logprobs():
    post = FakePoster({})
    assert run(ADAPTER.count_prompt(post, BASE, {"prompt": "Hi"}, 1.0)) is None
    assert post.sent == [] and ADAPTER.gives_logprobs is False
