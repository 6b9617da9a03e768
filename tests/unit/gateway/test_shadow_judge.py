"""The shadow run's judges: the built-ins, and the external HTTP judge's contract."""

import asyncio
import json
import socket
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from cascade.policy import LearningSettings
from gateway.learning.learner import Learner, answer_of
from tests.support.servers import serving
from workers.api.client import WorkerClient


class _Judge:
    """An HTTP judge on loopback (raw ASGI): records bodies, answers `reply` (status, JSON)."""

    def __init__(self, reply: tuple[int, object]) -> None:
        self.reply = reply
        self.seen: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 (ASGI)
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.seen.append(json.loads(body))
        status, answer = self.reply
        out = json.dumps(answer).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out})


def _gw() -> SimpleNamespace:
    return SimpleNamespace(workers=WorkerClient())


def _judge(gw, settings: LearningSettings, small: str, large: str, lp=()):  # noqa: ANN001
    learner = Learner(store=None, registry=CollectorRegistry())

    async def run():  # noqa: ANN202
        async with gw.workers:
            return await learner.judge(gw, settings, {"prompt": "2+2?"}, small, large, lp)

    return asyncio.run(run())


def test_http_judge_gets_prompt_and_both_answers_and_its_verdict_is_the_label() -> None:
    judge = _Judge((200, {"ok": False}))
    with serving(judge) as url:
        settings = LearningSettings(judge="http", judge_url=f"{url}/v1/judge")
        assert _judge(_gw(), settings, "5", "4") is False
    assert judge.seen == [{"prompt": "2+2?", "small": "5", "large": "4"}]


def test_http_judge_that_fails_or_says_nothing_leaves_the_label_undecided() -> None:
    for reply in ((500, {"error": "boom"}), (200, {"ok": "yes"}), (200, ["ok"])):
        with serving(_Judge(reply)) as url:
            settings = LearningSettings(judge="http", judge_url=f"{url}/")
            assert _judge(_gw(), settings, "a", "b") is None, reply
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}/"
    settings = LearningSettings(judge="http", judge_url=down)
    assert _judge(_gw(), settings, "a", "b") is None


def test_builtin_judges_through_the_learner() -> None:
    gw = _gw()
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
