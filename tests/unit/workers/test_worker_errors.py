"""The worker's one mapping of the engine's InvalidRequestError to an OpenAI-shaped 400."""

import json
from types import SimpleNamespace

from workers.errors import ContextLengthError, InvalidRequestError
from workers.server.app import CHAT_PATH, _invalid_request


def error_of(exc: InvalidRequestError, path: str) -> tuple[int, dict]:
    response = _invalid_request(SimpleNamespace(scope={"path": path}), exc)  # type: ignore[arg-type]
    return response.status_code, json.loads(json.dumps(response.content))["error"]


def test_an_invalid_request_is_a_400_naming_the_field_and_code():
    status, err = error_of(ContextLengthError(100, 50, 64), "/v1/completions")
    assert status == 400 and err["param"] == "max_tokens"
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"


def test_on_the_chat_endpoint_the_prompt_is_the_messages():
    exc = InvalidRequestError("the prompt is empty", "prompt")
    assert error_of(exc, CHAT_PATH)[1]["param"] == "messages"
    assert error_of(exc, "/v1/completions")[1]["param"] == "prompt"
