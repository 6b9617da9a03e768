"""A request resumed from another replica's output (`resume_token_ids`) continues exactly as
the uninterrupted one: the same tokens after the cut, greedy and seeded sampled, the text
not handed out yet (held back by the first replica's detokenizer) handed out first, and
its output counted from the start; a structured one goes on in its grammar."""

import json
from pathlib import Path

import pytest

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import GrammarSpec
from workers.errors import InvalidRequestError

N = 24


@pytest.fixture(scope="module")
def engine(demo_dir: Path) -> LLMEngine:
    return LLMEngine.from_pretrained(demo_dir, EngineConfig(num_kv_blocks=128, block_size=16))


def _run(engine: LLMEngine, params: SamplingParams, **kwargs) -> list:
    """The outputs of one request, step by step."""
    req = engine.add_request(prompt="The weather in Paris is", params=params, **kwargs)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == req.request_id]
    return outs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=N, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=N, temperature=1.0, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_a_resumed_request_continues_token_for_token_and_character_for_character(engine, params):
    whole = _run(engine, params)
    ids = [t for o in whole for t in o.new_token_ids]
    text = "".join(o.new_text for o in whole)
    assert len(ids) == N
    for cut in (1, 9, N - 1):
        handed_out = "".join(o.new_text for o in whole[:cut])  # what the client had
        rest = _run(engine, params, resume_token_ids=ids[:cut], resume_text_chars=len(handed_out))
        assert [t for o in rest for t in o.new_token_ids] == ids[cut:]
        assert handed_out + "".join(o.new_text for o in rest) == text
        assert rest[-1].num_output_tokens == N and rest[-1].finished


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"resume_token_ids": list(range(N))}, "resume_token_ids"),  # nothing left to make
        ({"resume_token_ids": [1, 10**9]}, "resume_token_ids"),
        ({"resume_token_ids": [40, 41], "resume_text_chars": 10**6}, "resume_text_chars"),
    ],
)
def test_a_resume_that_cannot_be_one_is_refused(engine, kwargs, param):
    with pytest.raises(InvalidRequestError) as refused:
        engine.make_request(prompt="hi", params=SamplingParams(max_tokens=N), **kwargs)
    assert refused.value.param == (param or "resume_token_ids")


SCHEMA = {
    "type": "object",
    # Closed choices, so that even the demo's random weights finish the document.
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def test_a_resumed_structured_request_goes_on_in_its_grammar(engine):
    """The matcher is advanced over the resumed output: the continuation is the same
    tokens, and the document validates; output the grammar never allowed is refused."""
    params = SamplingParams(max_tokens=N, temperature=0)
    spec = GrammarSpec.from_schema(SCHEMA)
    whole = _run(engine, params, grammar=spec)
    ids = [t for o in whole for t in o.new_token_ids]
    text = "".join(o.new_text for o in whole)
    assert whole[-1].finish_reason == "stop" and len(ids) > 4
    for cut in (1, len(ids) // 2, len(ids) - 1):
        handed_out = "".join(o.new_text for o in whole[:cut])
        rest = _run(
            engine, params, grammar=spec, resume_token_ids=ids[:cut],
            resume_text_chars=len(handed_out),
        )  # fmt: skip
        assert [t for o in rest for t in o.new_token_ids] == ids[cut:]
        assert handed_out + "".join(o.new_text for o in rest) == text
    assert set(json.loads(text)) == {"city", "days"}
    not_json = engine.tokenizer.encode("hello", False)
    with pytest.raises(InvalidRequestError) as refused:
        engine.make_request(prompt="hi", params=params, grammar=spec, resume_token_ids=not_json)
    assert refused.value.param == "resume_token_ids"
    assert "does not match the request's grammar" in str(refused.value)
