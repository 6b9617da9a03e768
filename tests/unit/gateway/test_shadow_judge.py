"""The shadow run's judges: the built-ins, and the external HTTP judge's contract."""

import asyncio
import json
from types import SimpleNamespace

import httpx
from prometheus_client import CollectorRegistry

from cascade.policy import LearningSettings
from gateway.shadow import Learner, answer_of


def _gw(handler) -> SimpleNamespace:  # noqa: ANN001
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return SimpleNamespace(workers=SimpleNamespace(http=client))


def _judge(gw, settings: LearningSettings, small: str, large: str, lp=()):  # noqa: ANN001
    learner = Learner(store=None, registry=CollectorRegistry())
    return asyncio.run(learner.judge(gw, settings, {"prompt": "2+2?"}, small, large, lp))


def test_http_judge_gets_prompt_and_both_answers_and_its_verdict_is_the_label() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"ok": False})

    settings = LearningSettings(judge="http", judge_url="http://judge.test/v1/judge")
    assert _judge(_gw(handler), settings, "5", "4") is False
    assert seen == [{"prompt": "2+2?", "small": "5", "large": "4"}]


def test_http_judge_that_fails_or_says_nothing_leaves_the_label_undecided() -> None:
    settings = LearningSettings(judge="http", judge_url="http://judge.test/")
    assert _judge(_gw(lambda r: httpx.Response(500)), settings, "a", "b") is None
    assert (
        _judge(_gw(lambda r: httpx.Response(200, json={"ok": "yes"})), settings, "a", "b") is None
    )

    def boom(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("down")

    assert _judge(_gw(boom), settings, "a", "b") is None


def test_builtin_judges_through_the_learner() -> None:
    gw = _gw(lambda r: httpx.Response(500))
    assert _judge(gw, LearningSettings(judge="final_answer"), "so (B)", "Answer: B") is True
    assert _judge(gw, LearningSettings(judge="exact"), "B", "C") is False
    unsure = LearningSettings(judge="confidence", judge_min_mean_logprob=-1.0)
    assert _judge(gw, unsure, "B", "", [-3.0, -2.0]) is False
    assert _judge(gw, unsure, "B", "", []) is None


def test_answer_of_reads_chat_and_completion_shapes() -> None:
    chat = {
        "choices": [{"message": {"content": "hi"}, "logprobs": {"content": [{"logprob": -0.5}]}}],
        "usage": {"completion_tokens": 1},
    }
    assert answer_of(chat) == ("hi", [-0.5], 1)
    comp = {"choices": [{"text": "yo", "logprobs": {"token_logprobs": [-0.1, None]}}]}
    assert answer_of(comp) == ("yo", [-0.1], None)
