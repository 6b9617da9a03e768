"""A resumable stream's bookkeeping (`gateway.serving.resume`), on plain data: which streams
may be resumed, the token ids cut out of the chunks the client gets, the text it has, the
continuation's body and the renaming of its chunks."""

import json

import pytest

from gateway.serving.plan import Plan
from gateway.serving.resume import StreamLog, continuation, quoted, resumable
from tests.unit.gateway.test_plan import chat, completion
from tests.unit.gateway.test_plan import plan as base_plan


def plan(**fields) -> Plan:
    """A streamed chat request's plan."""
    return base_plan(**{"chat": True, "stream": True, **fields})


@pytest.mark.parametrize(
    ("req", "p", "kind", "limit", "why"),
    [
        (chat(), plan(), "switchyard", 2, None),
        (chat(), plan(), "switchyard", 0, "stream_resumes is 0"),
        (chat(), plan(stream=False), "switchyard", 2, "not a stream"),
        (chat(), plan(n=2), "switchyard", 2, "n > 1"),
        (chat(), plan(), "vllm", 2, "a vllm pool takes no forced prefix"),
        (
            chat(tools=[{"type": "function", "function": {"name": "f"}}]),
            plan(),
            "switchyard",
            2,
            "tools",
        ),
        (
            chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none"),
            plan(),
            "switchyard",
            2,
            None,
        ),
        (chat(response_format={"type": "json_object"}), plan(), "switchyard", 2, "response_format"),
        (
            completion(),
            plan(chat=False),
            "switchyard",
            2,
            None,
        ),
    ],
)
def test_which_streams_may_be_resumed(req, p, kind, limit, why):
    assert resumable(req, p, kind, limit) == why


def test_token_ids_are_cut_out_of_what_the_client_gets_and_kept():
    log = StreamLog()
    first = b'{"id":"a","choices":[{"index":0,"delta":{"role":"assistant","content":"He"},"finish_reason":null,"token_ids":[5,6]}]}'  # noqa: E501
    later = b'{"id":"a","choices":[{"index":0,"delta":{"content":"llo \\"x\\""},"finish_reason":null,"token_ids":[7]}]}'  # noqa: E501
    sent = [log.output(first), log.output(later)]
    assert all(b"token_ids" not in s for s in sent)
    assert json.loads(sent[1])["choices"][0] == {
        "index": 0,
        "delta": {"content": 'llo "x"'},
        "finish_reason": None,
    }
    assert log.token_ids == [5, 6, 7] and log.complete
    assert log.text_chars(chat=True) == len('Hello "x"')
    body = json.loads(continuation(b'{"model":"small","stream":true}', log, chat=True))
    assert body == {
        "model": "small",
        "stream": True,
        "resume_token_ids": [5, 6, 7],
        "resume_text_chars": 9,
        "return_token_ids": True,
    }


def test_a_chunk_without_ids_makes_the_stream_not_resumable_and_no_ids_is_a_fresh_start():
    log = StreamLog()
    assert continuation(b'{"model":"small"}', log, chat=False) == b'{"model":"small"}'
    log.output(b'{"id":"a","choices":[{"index":0,"text":"x","finish_reason":null}]}')
    assert not log.complete and log.token_ids == []
    assert log.text_chars(chat=False) == 1


def test_a_continuations_events_take_the_first_streams_id():
    log = StreamLog()
    log.rename = (quoted("cmpl-new"), quoted("cmpl-first"))
    assert log.renamed(b'{"id":"cmpl-new","choices":[]}') == b'{"id":"cmpl-first","choices":[]}'
