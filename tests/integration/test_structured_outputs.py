"""Structured outputs: every output of a random-weight model validates against its schema,
streaming and not, sampled and greedy, also when the KV pool is so small that requests
are preempted and recomputed; unsupported schema features are a 400 naming them."""

import json

import httpx
import pytest

from tests.support.worker import running_worker
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import GrammarSpec

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "arrays_enums": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "size": {"enum": ["S", "M", "L"]},
        },
        "required": ["colors", "size"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "ok"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": -5, "maximum": 5},
                    {"type": "string", "maxLength": 6},
                    {"type": "null"},
                ]
            },
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["value"],
        "additionalProperties": False,
    },
}
MAX_TOKENS = 200


def _body(schema, chat=True, **kw):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    common = {"model": "small", "max_tokens": MAX_TOKENS, "response_format": fmt, **kw}
    if chat:
        return {"messages": [{"role": "user", "content": "Give me JSON."}], **common}
    return {"prompt": "JSON:", **common}


@pytest.fixture(scope="module")
def worker(demo_dir):
    with running_worker(demo_dir) as w:
        yield w


def _check(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_validates_non_streaming(worker, name):
    schema = SCHEMAS[name]
    for i, chat in enumerate((True, False, True)):
        body = _body(schema, chat=chat, temperature=1.0, seed=100 + i, n=2)
        r = httpx.post(
            f"{worker.url}/v1/{'chat/completions' if chat else 'completions'}",
            json=body,
            timeout=60,
        )
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop"
            _check(choice["message"]["content"] if chat else choice["text"], schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_streamed_output_validates(worker, name):
    schema = SCHEMAS[name]
    body = _body(schema, stream=True, temperature=0.9, seed=7)
    parts, finish = [], None
    with httpx.stream("POST", f"{worker.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                parts.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
    assert finish == "stop"
    _check("".join(parts), schema)


def test_json_object_gives_a_json_object(worker):
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": "JSON please"}],
        "response_format": {"type": "json_object"},
        "max_tokens": 40,
        "temperature": 0,
    }
    r = httpx.post(f"{worker.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # max_tokens cut the document: the partial document, as OpenAI does
        assert choice["finish_reason"] == "length"


@pytest.mark.parametrize(
    "schema, feature",
    [
        ({"type": "object", "if": {"required": ["a"]}, "then": {}}, "if"),
        ({"not": {"type": "string"}}, "not"),
    ],
)
def test_unsupported_schema_features_are_a_400_naming_them(worker, schema, feature):
    r = httpx.post(f"{worker.url}/v1/chat/completions", json=_body(schema), timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format"
    assert feature in err["message"]


def test_json_schema_without_a_schema_field_is_a_400(worker):
    body = _body({})
    body["response_format"] = {"type": "json_schema"}
    r = httpx.post(f"{worker.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_schemas_compile_once_and_are_served_from_the_cache(demo_dir):
    engine = LLMEngine.from_pretrained(
        demo_dir,
        EngineConfig(num_kv_blocks=64, block_size=16, scheduler=SchedulerConfig(max_num_seqs=8)),
    )
    spec = GrammarSpec.from_schema(SCHEMAS["numbers"])
    for _ in range(5):
        engine.make_request(prompt="x", params=SamplingParams(max_tokens=8), grammar=spec)
    stats = engine.grammars.stats
    assert stats.num_compiles == 1 and stats.num_hits == 4


def test_outputs_validate_under_forced_preemption(demo_dir):
    """A KV pool too small for the batch: requests are preempted and recomputed, and their
    grammar state stays consistent with the tokens they keep."""
    engine = LLMEngine.from_pretrained(
        demo_dir,
        EngineConfig(
            num_kv_blocks=12,
            block_size=4,
            enable_prefix_caching=False,
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        ),
    )
    names = sorted(SCHEMAS)
    reqs = []
    for i in range(8):
        schema = SCHEMAS[names[i % len(names)]]
        reqs.append(
            engine.add_request(
                prompt="JSON:",
                params=SamplingParams(max_tokens=36, temperature=1.0, seed=i, ignore_eos=True),
                grammar=GrammarSpec.from_schema(schema),
            )
        )
    texts = {r.request_id: "" for r in reqs}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.new_text
    assert engine.scheduler.num_preemptions > 0
    for i, r in enumerate(reqs):
        text = texts[r.request_id]
        if r.finish_reason.value == "stop":
            _check(text, SCHEMAS[names[i % len(names)]])
        else:  # cut by max_tokens: what there is must still be a prefix the grammar allows
            assert r.finish_reason.value == "length"
        replayed = type(r.guide)(r.guide.pristine, r.guide.compiler)
        replayed.replay(r.output_token_ids)
        assert replayed.num_tokens == len(r.output_token_ids)


def test_real_model_outputs_validate(real_model_dir):
    """The real checkpoint (SmolLM2-135M-Instruct, a 49k vocabulary) under the same schemas."""
    engine = LLMEngine.from_pretrained(
        real_model_dir,
        EngineConfig(num_kv_blocks=256, block_size=16, scheduler=SchedulerConfig(max_num_seqs=8)),
    )
    names = ["nested", "arrays_enums", "numbers", "any_of"]
    reqs = [
        engine.add_request(
            prompt="Reply with a JSON object describing a person.\n",
            params=SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=i),
            grammar=GrammarSpec.from_schema(SCHEMAS[name]),
        )
        for i, (name, t) in enumerate((n, t) for n in names for t in (0.0, 1.0))
    ]
    texts = {r.request_id: "" for r in reqs}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.new_text
    for i, r in enumerate(reqs):
        assert r.finish_reason.value == "stop", texts[r.request_id]
        _check(texts[r.request_id], SCHEMAS[names[i // 2]])
