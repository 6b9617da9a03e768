"""A resumable stream's bookkeeping (`gateway.serving.resume`), on plain data: which streams
may be resumed, the token ids cut out of the chunks the client gets, the text it has, the
continuation's body and the renaming of its chunks."""

import json

import pytest

from gateway.serving.plan import Plan
from gateway.serving.resume import StreamLog, continuation, quoted, resumable
from tests.unit.gateway.test_plan import plan as base_plan


def plan(**fields) -> Plan:
    """A streamed chat request's plan."""
    return base_plan(**{"chat": True, "stream": True, **fields})


@pytest.mark.parametrize(
    ("p", "kind", "limit", "why"),
    [
        (plan(), "switchyard", 2, None),
        (plan(), "switchyard", 0, "stream_resumes is 0"),
        (plan(stream=False), "switchyard", 2, "not a stream"),
        (plan(n=2), "switchyard", 2, "n > 1"),
        (plan(), "vllm", 2, "a vllm pool takes no forced prefix"),
        (plan(), "sglang", 2, "a sglang pool takes no forced prefix"),
        (plan(chat=False), "switchyard", 2, None),
    ],
)
def test_which_streams_may_be_resumed(p, kind, limit, why):
    """Tools and structured outputs too (the worker goes on in their grammar and reader)."""
    assert resumable(p, kind, limit) == why


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


def test_the_text_the_worker_handed_out_is_what_it_says_when_it_says():
    """A tool call's text is held back from the client until whole: the worker's
    `text_chars` (after the ids) counts it, and is cut out with them."""
    log = StreamLog()
    held = b'{"id":"a","choices":[{"index":0,"delta":{},"finish_reason":null,"token_ids":[5,6],"text_chars":12}]}'  # noqa: E501
    sent = log.output(held)
    assert json.loads(sent)["choices"][0] == {"index": 0, "delta": {}, "finish_reason": None}
    assert log.token_ids == [5, 6] and log.reported_chars == 12
    assert log.text_chars(chat=True) == 12  # the client has none of it as content
    odd = b'{"choices":[{"index":0,"text":"x","token_ids":[7],"text_chars":-1}]}'
    assert json.loads(log.output(odd))["choices"][0] == {"index": 0, "text": "x", "text_chars": -1}
    assert log.reported_chars == 12  # what is not a count is left alone


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
