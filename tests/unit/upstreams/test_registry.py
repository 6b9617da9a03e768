import pytest

from tests.unit.upstreams.fakes import BASE, FakeGetter, fixture, run
from workers.api.upstreams import llamacpp, ollama, openai, sglang, tgi, vllm
from workers.api.upstreams.base import KINDS
from workers.api.upstreams.registry import adapter_for, detect


def test_adapter_for_every_foreign_kind():
    modules = {"vllm": vllm, "sglang": sglang, "llamacpp": llamacpp, "tgi": tgi}
    modules |= {"ollama": ollama, "openai": openai}
    assert set(modules) == set(KINDS) - {"switchyard"}
    for kind, module in modules.items():
        assert adapter_for(kind) is module.ADAPTER and adapter_for(kind).kind == kind


def test_adapter_for_switchyard_or_an_unknown_kind_refuses():
    with pytest.raises(ValueError, match="/load"):
        adapter_for("switchyard")
    with pytest.raises(ValueError, match="unknown upstream kind 'triton'"):
        adapter_for("triton")


@pytest.mark.parametrize(
    ("path", "body", "kind", "says"),
    [
        ("/props", fixture("llamacpp", "props.json"), "llamacpp", "GET /props"),
        ("/api/version", fixture("ollama", "version.json"), "ollama", "GET /api/version"),
        ("/api/ps", fixture("ollama", "ps.json"), "ollama", "GET /api/ps"),
        ("/info", fixture("tgi", "info.json"), "tgi", "GET /info"),
        ("/metrics", fixture("vllm", "metrics.txt"), "vllm", "vllm:"),
        ("/metrics", fixture("vllm", "metrics_v0.txt"), "vllm", "vllm:"),
        ("/get_model_info", fixture("sglang", "get_model_info.json"), "sglang", "/get_model_info"),
        ("/get_server_info", fixture("sglang", "get_server_info.json"), "sglang", "server"),
        ("/metrics", fixture("sglang", "metrics_underscore.txt"), "sglang", "sglang_"),
        ("/metrics", fixture("llamacpp", "metrics.txt"), "llamacpp", "llamacpp:"),
        ("/metrics", fixture("tgi", "metrics.txt"), "tgi", "tgi_"),
        ("/load", fixture("switchyard", "load.json"), "switchyard", "GET /load"),
    ],
)
def test_detect_decides_on_one_unambiguous_answer(path, body, kind, says):
    getter = FakeGetter({path: (200, body), "/v1/models": (200, b'{"data":[]}')})
    found, sentence = run(detect(getter, BASE, 1.0))
    assert found == kind and says in sentence


def test_detect_accepts_several_signs_of_one_kind():
    routes = {
        "/get_model_info": (200, fixture("sglang", "get_model_info.json")),
        "/metrics": (200, fixture("sglang", "metrics.txt")),
    }
    assert run(detect(FakeGetter(routes), BASE, 1.0))[0] == "sglang"


def test_detect_refuses_when_two_kinds_answer():
    routes = {
        "/props": (200, fixture("llamacpp", "props.json")),
        "/metrics": (200, fixture("vllm", "metrics.txt")),
    }
    with pytest.raises(ValueError, match="more than one kind") as refused:
        run(detect(FakeGetter(routes), BASE, 1.0))
    assert "llamacpp" in str(refused.value) and "vllm" in str(refused.value)


def test_detect_refuses_a_plain_openai_server_and_says_what_it_tried():
    getter = FakeGetter({"/v1/models": (200, b'{"data":[{"id":"m"}]}'), "/metrics": (200, b"")})
    with pytest.raises(ValueError, match="no endpoint tells its kind") as refused:
        run(detect(getter, BASE, 1.0))
    for path in ("/load", "/props", "/info", "/get_model_info", "/api/version", "/metrics"):
        assert path in str(refused.value)


def test_detect_does_not_guess_from_lookalike_answers():
    routes = {
        "/api/version": (200, b'{"version":"1.2","name":"some-app"}'),  # not Ollama's alone
        "/info": (200, b'{"model_id":"x"}'),  # no max_input_tokens
        "/props": (200, b'{"total_slots":1}'),
        "/metrics": (200, b"# TYPE http_requests_total counter\nhttp_requests_total 3\n"),
    }
    with pytest.raises(ValueError):
        run(detect(FakeGetter(routes), BASE, 1.0))


def test_detect_refuses_when_nothing_answers():
    with pytest.raises(ValueError, match="no answer"):
        run(detect(FakeGetter({}, refuse=True), BASE, 1.0))
