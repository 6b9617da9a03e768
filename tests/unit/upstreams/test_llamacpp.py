import json

import pytest

from tests.unit.upstreams.fakes import BASE, FakeGetter, FakePoster, fixture, run
from workers.api.client import WorkerUnavailable
from workers.api.upstreams.llamacpp import ADAPTER


def routes(**over: tuple[int | None, bytes]) -> dict[str, tuple[int | None, bytes]]:
    r: dict[str, tuple[int | None, bytes]] = {
        "/health": (200, fixture("llamacpp", "health_ok.json")),
        "/props": (200, fixture("llamacpp", "props.json")),
        "/slots": (200, fixture("llamacpp", "slots_one_busy.json")),
        "/metrics": (501, b"This server does not support metrics endpoint."),
    }
    r.update({"/" + k: v for k, v in over.items()})
    return r


def test_probe_without_metrics_counts_busy_slots_and_leaves_the_queue_unknown():
    load = run(ADAPTER.probe(FakeGetter(routes()), BASE, 1.0))
    assert load.state == "ready"
    assert load.num_running == 1  # one of the two slots is_processing
    assert load.num_waiting is None  # only --metrics says how many are deferred
    assert load.kv_usage is None
    assert (load.slots, load.max_model_len) == (1, 1024)  # total_slots, n_ctx per slot
    assert load.model == "../models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf"
    assert load.source == "GET /health, GET /props, GET /slots"


def test_probe_with_metrics_reads_deferred_requests():
    load = run(
        ADAPTER.probe(
            FakeGetter(routes(metrics=(200, fixture("llamacpp", "metrics.txt")))), BASE, 1.0
        )
    )
    assert (load.num_running, load.num_waiting) == (1, 3)  # /slots first, then deferred


def test_slots_disabled_501_falls_back_to_requests_processing():
    r = routes(
        slots=(501, fixture("llamacpp", "slots_disabled.json")),
        metrics=(200, fixture("llamacpp", "metrics.txt")),
    )
    load = run(ADAPTER.probe(FakeGetter(r), BASE, 1.0))
    assert (load.num_running, load.num_waiting) == (2, 3)


def test_slots_and_metrics_both_off_leave_running_unknown():
    load = run(ADAPTER.probe(FakeGetter(routes(slots=(501, b""))), BASE, 1.0))
    assert (load.num_running, load.num_waiting, load.slots) == (None, None, 1)


def test_the_documented_two_slot_example_has_both_busy():
    load = run(
        ADAPTER.probe(FakeGetter(routes(slots=(200, fixture("llamacpp", "slots.json")))), BASE, 1.0)
    )
    assert load.num_running == 2


def test_loading_model_503_is_loading_with_its_message():
    load = run(
        ADAPTER.probe(
            FakeGetter(routes(health=(503, fixture("llamacpp", "health_loading.json")))), BASE, 1.0
        )
    )
    assert (load.state, load.reason) == ("loading", "GET /health: 503 Loading model")
    assert load.slots is None


def test_refused_is_unreachable():
    assert run(ADAPTER.probe(FakeGetter({}, refuse=True), BASE, 1.0)).state == "unreachable"


@pytest.mark.parametrize(
    ("status", "body", "busy"),
    [
        (503, fixture("llamacpp", "health_loading.json"), True),
        (400, b'{"error":{"code":400,"message":"bad","type":"invalid_request_error"}}', False),
        (501, fixture("llamacpp", "slots_disabled.json"), False),
        (
            200,
            b"data: " + fixture("llamacpp", "health_loading.json").strip() + b"\n\n",
            True,
        ),
        (
            200,
            b'data: {"error":{"code":400,"message":"bad","type":"invalid_request_error"}}\n\n',
            False,
        ),
    ],
)
def test_overloaded(status, body, busy):
    assert ADAPTER.overloaded(status, body) is busy


def test_count_prompt_of_messages_applies_the_template_then_tokenizes():
    template = json.loads(fixture("llamacpp", "apply_template.json"))
    post = FakePoster(
        {
            "/apply-template": (200, template),
            "/tokenize": (200, json.loads(fixture("llamacpp", "tokenize.json"))),
        }
    )
    messages = [{"role": "user", "content": "Hello"}]
    assert run(ADAPTER.count_prompt(post, BASE, {"messages": messages}, 1.0)) == 3
    assert post.sent == [
        ("/apply-template", {"messages": messages}),
        ("/tokenize", {"content": template["prompt"]}),
    ]


def test_count_prompt_of_a_plain_prompt_only_tokenizes():
    post = FakePoster({"/tokenize": (200, {"tokens": [1, 2]})})
    assert run(ADAPTER.count_prompt(post, BASE, {"prompt": "Hi"}, 1.0)) == 2
    assert post.sent == [("/tokenize", {"content": "Hi"})]


@pytest.mark.parametrize(
    "poster",
    [
        FakePoster({"/apply-template": (503, None), "/tokenize": (200, {"tokens": [1]})}),
        FakePoster({}, raises=WorkerUnavailable(BASE, "refused")),
    ],
)
def test_count_prompt_is_none_when_a_step_fails(poster):
    assert run(ADAPTER.count_prompt(poster, BASE, {"messages": []}, 1.0)) is None
    assert all(path != "/tokenize" for path, _ in poster.sent)
