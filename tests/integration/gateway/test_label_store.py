"""The label store in a real Redis: one label per request and source, the first (a later
one writes nothing and is told the first's verdict), also when many are added at once
through several clients (as from several gateways); the stream's bound; tenants apart."""

import asyncio

import msgspec

from cascade.labels import Label
from cascade.policy import LearningSettings
from gateway.learning.label_store import LabelStore, Verdict
from tests.integration.gateway.conftest import run_on_clients

SETTINGS = LearningSettings(keep_prompts=True, max_labels=1000)


def _label(request_id: str, source: str, ok: bool, at: float, tenant: str = "acme") -> Label:
    return Label(
        tenant=tenant,
        request_id=request_id,
        source=source,
        weak_ok=ok,
        strong_ok=True,
        served_pool="small",
        features=[1.0],
        time=at,
    )


def _run(redis_url: str, body, num_clients: int = 1):  # noqa: ANN001, ANN202
    return run_on_clients(redis_url, LabelStore, body, num_clients)


def test_a_request_keeps_one_label_per_source_the_first(redis_url):
    async def body(store):  # noqa: ANN001, ANN202
        answers = [
            await store.add(_label("r1", "feedback", i % 2 == 0, i), SETTINGS, {"prompt": f"{i}"})
            for i in range(301)
        ]
        other_source = await store.add(_label("r1", "shadow", False, 400), SETTINGS)
        other_request = await store.add(_label("r2", "feedback", False, 401), SETTINGS)
        labels = await store.labels("acme")
        prompts = await store.prompts("acme", ["r1"])
        return answers, (other_source, other_request), labels, prompts, await store.count("acme")

    answers, others, labels, prompts, count = _run(redis_url, body)
    assert answers == [None] + [Verdict(True, True)] * 300  # each later one told the first's
    assert others == (None, None)
    assert count == 3
    assert [(lab.request_id, lab.source, lab.weak_ok, lab.time) for lab in labels] == [
        ("r1", "feedback", True, 0),
        ("r1", "shadow", False, 400),
        ("r2", "feedback", False, 401),
    ]
    assert prompts == {"r1": {"prompt": "0"}}


def test_labels_added_at_once_through_two_clients_are_one_label(redis_url):
    async def body(one, two):  # noqa: ANN001, ANN202
        adds = [
            (one, two)[i % 2].add(_label("r1", "feedback", i % 3 == 0, i), SETTINGS)
            for i in range(200)
        ]
        answers = await asyncio.gather(*adds)
        return answers, await one.labels("acme")

    answers, labels = _run(redis_url, body, num_clients=2)
    assert answers.count(None) == 1, answers.count(None)
    assert len(labels) == 1
    first = Verdict.of(labels[0])
    assert all(a == first for a in answers if a is not None)


def test_the_stream_stays_bounded_and_another_tenant_is_apart(redis_url):
    small = LearningSettings(max_labels=100)

    async def body(store):  # noqa: ANN001, ANN202
        for i in range(1000):
            await store.add(_label(f"r{i}", "shadow", True, i), small)
        theirs = msgspec.structs.replace(_label("r1", "shadow", False, 0), tenant="globex")
        assert await store.add(theirs, small) is None  # the same request id, another tenant
        return await store.count("acme"), await store.count("globex")

    count, other = _run(redis_url, body)
    assert 100 <= count < 1000
    assert other == 1
