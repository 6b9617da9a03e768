"""The worker's side of a resumed stream, over HTTP: `return_token_ids` names each chunk's
tokens, and a request with `resume_token_ids` streams on from there (no role chunk, no
text twice) with usage counting the whole output, a tool call cut in its arguments going
on to the same call; what it cannot continue is a 400."""

import json

import httpx
import pytest

from tests.support.worker import running_worker

N = 16
CHAT = {
    "model": "small",
    "messages": [{"role": "user", "content": "Tell me about the weather"}],
    "max_tokens": N,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@pytest.fixture(scope="module")
def worker(demo_dir):
    with running_worker(demo_dir) as w:
        yield w


def _chunks(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


def _text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_a_resumed_chat_stream_carries_on_where_the_client_was(worker):
    whole = _chunks(worker.url, {**CHAT, "return_token_ids": True})
    outputs = [c for c in whole if c["choices"]]
    ids = [t for c in outputs for t in c["choices"][0]["token_ids"]]
    assert len(ids) == N and whole[-1]["usage"]["completion_tokens"] == N
    cut = 6
    had = _text(outputs[:cut])
    resumed = _chunks(
        worker.url,
        {
            **CHAT,
            "resume_token_ids": ids[:cut],
            "resume_text_chars": len(had),
            "return_token_ids": True,
        },
    )
    rest = [c for c in resumed if c["choices"]]
    assert all("role" not in c["choices"][0]["delta"] for c in rest)
    assert had + _text(rest) == _text(outputs)
    assert [t for c in rest for t in c["choices"][0]["token_ids"]] == ids[cut:]
    usage = resumed[-1]["usage"]
    assert usage["completion_tokens"] == N
    assert usage["prompt_tokens"] == whole[-1]["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"stream": False, "stream_options": None}, "a stream"),
        ({"n": 2}, "n = 1"),
        ({"resume_token_ids": None}, "needs resume_token_ids"),
    ],
)
def test_what_a_resume_cannot_continue_is_a_400(worker, extra, says):
    body = {**CHAT, "resume_token_ids": [40, 41], "resume_text_chars": 1, **extra}
    r = httpx.post(f"{worker.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {  # closed choices, so that the demo's random weights finish it
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}


def test_a_tool_call_cut_in_its_arguments_goes_on_to_the_same_call(worker):
    """A forced call streams as one `tool_calls` delta once whole; cut before it, the
    continuation (its grammar and its call reader primed with the text so far) sends the
    same call, and the chunks' `text_chars` say what a continuation starts from."""
    body = {
        **CHAT,
        "max_tokens": 64,
        "ignore_eos": False,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "return_token_ids": True,
    }
    whole = [c for c in _chunks(worker.url, body) if c["choices"]]
    (at,) = [i for i, c in enumerate(whole) if c["choices"][0]["delta"].get("tool_calls")]
    (call,) = whole[at]["choices"][0]["delta"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    ids = [t for c in whole for t in c["choices"][0]["token_ids"]]
    cut = at // 2 + 1  # the client has read some of the call's tokens, and no call yet
    assert 0 < cut < at and not any(c["choices"][0]["delta"].get("tool_calls") for c in whole[:cut])
    rest = [
        c
        for c in _chunks(
            worker.url,
            {
                **body,
                "resume_token_ids": ids[:cut],
                "resume_text_chars": whole[cut - 1]["choices"][0]["text_chars"],
            },
        )
        if c["choices"]
    ]
    calls = [tc for c in rest for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [(c["index"], c["function"]) for c in calls] == [(0, call["function"])]
    assert rest[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [t for c in rest for t in c["choices"][0]["token_ids"]] == ids[cut:]
    off_grammar = {**body, "resume_token_ids": [40, 41], "resume_text_chars": 0}
    r = httpx.post(f"{worker.url}/v1/chat/completions", json=off_grammar, timeout=60)
    assert r.status_code == 400 and "grammar" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("grace", [-1, "soon"])
def test_a_drain_grace_that_is_not_one_is_a_400_and_drains_nothing(worker, grace):
    r = httpx.post(f"{worker.url}/drain", json={"grace_s": grace}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("grace_s", None)
    assert httpx.get(f"{worker.url}/ready", timeout=10).json()["state"] == "ready"
