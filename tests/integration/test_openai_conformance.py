"""Every response object, from the worker and through the gateway, validates against the
JSON schemas of OpenAI's published OpenAPI document (a vendored extract, MIT: see
tests/support/openai_spec/): models, chat and completions, each stream chunk, logprobs,
tool calls, errors.

The document is OpenAPI 3.1 but still marks some fields `nullable: true` (the 3.0 way,
which JSON Schema ignores): those are read as "this schema, or null".

One adjustment, named here: a completions stream chunk is validated as
`CreateCompletionResponse` with `finish_reason` also allowed to be null, since the
document has no chunk schema for completions and OpenAI's own streams send null there.
"""

import copy
import json
import tempfile
from pathlib import Path

import httpx
import pytest

from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.runtime.main import build_gateway
from tests.support.checkpoints import with_chat_template
from tests.support.redis_server import redis_url as start_redis
from tests.support.servers import serving
from tests.support.worker import running_worker

jsonschema = pytest.importorskip("jsonschema")


def _nullable(node):
    """`{..., "nullable": true}` (OpenAPI 3.0) as `{"anyOf": [{...}, {"type": "null"}]}`."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


SPEC_DIR = Path(__file__).parents[1] / "support/openai_spec"
SPEC = _nullable(json.loads((SPEC_DIR / "openai-openapi-extract.json").read_text()))
RESPONSES_SPEC = _nullable(
    json.loads((SPEC_DIR / "openai-openapi-responses-extract.json").read_text())
)
ADMIN = "admin-conformance"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _validator(name: str, spec: dict = SPEC):
    schema = {**spec, "$ref": f"#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(schema)


def _completion_chunk_validator():
    spec = copy.deepcopy(SPEC)
    choice = spec["components"]["schemas"]["CreateCompletionResponse"]["properties"]["choices"]
    reason = choice["items"]["properties"]["finish_reason"]
    choice["items"]["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
    return _validator("CreateCompletionResponse", spec)


VALIDATORS = {
    "models": _validator("ListModelsResponse"),
    "chat": _validator("CreateChatCompletionResponse"),
    "chat_chunk": _validator("CreateChatCompletionStreamResponse"),
    "completion": _validator("CreateCompletionResponse"),
    "completion_chunk": _completion_chunk_validator(),
    "error": _validator("ErrorResponse"),
    "response": _validator("Response", RESPONSES_SPEC),
}


def _event_validators() -> dict[str, object]:
    """A validator per Responses stream event type, from the members of the document's
    `ResponseStreamEvent` union (its own errors name the failing field, the union's not)."""
    schemas = RESPONSES_SPEC["components"]["schemas"]
    out = {}
    for member in schemas["ResponseStreamEvent"]["anyOf"]:
        name = member["$ref"].rsplit("/", 1)[-1]
        for kind in schemas[name]["properties"]["type"].get("enum", []):
            out[kind] = _validator(name, RESPONSES_SPEC)
    return out


EVENT_VALIDATORS = _event_validators()


def conform_event(event: dict) -> None:
    validator = EVENT_VALIDATORS[event["type"]]
    errors = sorted(validator.iter_errors(event), key=str)
    assert not errors, f"{event['type']}: {errors[0].message} at {list(errors[0].absolute_path)}"


def conform(kind: str, obj: dict) -> None:
    errors = sorted(VALIDATORS[kind].iter_errors(obj), key=str)
    assert not errors, f"{kind}: {errors[0].message} at {list(errors[0].absolute_path)}"


def _chunks(client: httpx.Client, path: str, body: dict) -> list[dict]:
    out = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def check_every_endpoint(client: httpx.Client) -> None:
    """The same checks against a worker or a gateway."""
    conform("models", client.get("/v1/models").json())
    chat = {"model": "small", "messages": USER, "max_tokens": 8, "temperature": 0}
    with_lp = {**chat, "logprobs": True, "top_logprobs": 2}
    r = client.post("/v1/chat/completions", json=with_lp)
    assert r.status_code == 200, r.text
    body = r.json()
    conform("chat", body)
    assert body["choices"][0]["message"]["refusal"] is None
    assert body["choices"][0]["logprobs"]["refusal"] is None
    tools = {**chat, "tools": TOOLS, "tool_choice": FORCED, "max_tokens": 60, "n": 2}
    body = client.post("/v1/chat/completions", json=tools).json()
    conform("chat", body)
    assert all(c["message"]["tool_calls"] for c in body["choices"])
    stream = {**with_lp, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _chunks(client, "/v1/chat/completions", stream)
    chunks += _chunks(client, "/v1/chat/completions", {**tools, "stream": True})
    assert chunks
    for c in chunks:
        conform("chat_chunk", c)
    completion = {"model": "small", "prompt": "Hello", "max_tokens": 6, "logprobs": 2}
    conform("completion", client.post("/v1/completions", json=completion).json())
    stream = {**completion, "stream": True, "stream_options": {"include_usage": True}}
    for c in _chunks(client, "/v1/completions", stream):
        conform("completion_chunk", c)
    r = client.post("/v1/chat/completions", json={**chat, "temperature": 9})
    assert r.status_code == 400
    conform("error", r.json())


@pytest.fixture(scope="module")
def tool_dir(demo_dir, tmp_path_factory):
    return with_chat_template(demo_dir, tmp_path_factory.mktemp("conform") / "small")


@pytest.fixture(scope="module")
def worker(tool_dir):
    with running_worker(tool_dir) as w:
        yield w


def test_worker_responses_conform_to_openais_schemas(worker):
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        check_every_endpoint(client)
        r = client.post("/v1/chat/completions", json={"model": "nope", "messages": USER})
        conform("error", r.json())


@pytest.fixture(scope="module")
def gateway_client(worker, tool_dir):
    """A client of a gateway in front of `worker`, with a tenant's key."""
    with start_redis() as redis_url, tempfile.TemporaryDirectory() as data_dir:
        import redis

        redis.Redis.from_url(redis_url).flushdb()
        cfg = GatewayConfig(
            pools={"small": [worker.url]},
            tokenizers={"small": str(tool_dir)},
            data_dir=data_dir,
            admin_key=ADMIN,
            default_pool="small",
            load_poll_interval_s=0.05,
        )
        with serving(create_gateway_app(build_gateway(cfg, redis_url))) as url:
            admin = {"authorization": f"Bearer {ADMIN}"}
            for _ in range(200):
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            r = httpx.post(f"{url}/admin/tenants", json={"tenant_id": "t1"}, headers=admin)
            assert r.status_code == 201, r.text
            key = httpx.post(
                f"{url}/admin/tenants/t1/keys", json={"name": "k"}, headers=admin
            ).json()["key"]
            headers = {"authorization": f"Bearer {key}"}
            with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
                yield client


def test_gateway_responses_conform_to_openais_schemas(gateway_client):
    check_every_endpoint(gateway_client)
    conform("error", httpx.get(f"{gateway_client.base_url}/v1/models").json())  # no key: 401


def _events(client: httpx.Client, body: dict) -> list[dict]:
    out = []
    with client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
    return out


def test_the_responses_api_conforms_to_openais_schemas(gateway_client):
    """Responses (text with logprobs, a forced function call, a JSON schema), each stream
    event, a stored response read back and an error, against the Responses schemas."""
    client = gateway_client
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
    text = {"model": "small", "input": "Hello", "max_output_tokens": 6, "temperature": 0}
    bodies = [
        {**text, "include": ["message.output_text.logprobs"], "top_logprobs": 2},
        {
            **text,
            "instructions": "use the tool",
            "tools": [tool],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 60,
        },
        {
            **text,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}},
            "max_output_tokens": 60,
            "metadata": {"k": "v"},
        },
    ]
    kinds = set()
    for body in bodies:
        r = client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        conform("response", r.json())
        kinds.update(item["type"] for item in r.json()["output"])
        events = _events(client, {**body, "stream": True})
        for event in events:
            conform_event(event)
        conform("response", client.get(f"/v1/responses/{events[-1]['response']['id']}").json())
    assert kinds == {"message", "function_call"}
    r = client.post("/v1/responses", json={**text, "temperature": 9})
    assert r.status_code == 400
    conform("error", r.json())
    conform("error", client.get("/v1/responses/resp_nope").json())
