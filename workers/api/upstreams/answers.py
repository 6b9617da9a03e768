"""Reading what a foreign server answers: JSON bodies, numbers, the first SSE event, and the
prompt-count POST every tokenizing adapter makes. Everything here treats the answer as
untrusted: a body that does not parse, or a number out of range, reads as None (unknown)."""

import asyncio
import json
import math
from typing import Any

from workers.api.upstreams.base import Getter, Poster, UpstreamLoad

MAX_TOKENS = 1 << 24  # no context length or prompt count above this is believed
_TEMPLATE_SLACK_TOKENS = 1024  # special tokens a chat template may add to a prompt


def json_or_none(body: bytes) -> Any:
    """The decoded JSON body, or None when it is not JSON."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def count_or_none(value: Any) -> int | None:
    """A non-negative whole count (requests, slots), or None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0 or value != int(value):
        return None
    return int(value)


def tokens_or_none(value: Any) -> int | None:
    """A positive token count (a context length) up to MAX_TOKENS, else None."""
    count = count_or_none(value)
    return count if count is not None and 0 < count <= MAX_TOKENS else None


def fraction_or_none(value: Any) -> float | None:
    """A fraction clamped to 0..1, or None when it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return min(max(float(value), 0.0), 1.0)


async def get_all(
    get: Getter, base_url: str, paths: tuple[str, ...], timeout_s: float
) -> dict[str, tuple[int | None, bytes]]:
    """GET every path at once, so a probe takes one `timeout_s`, not one per endpoint."""
    answers = await asyncio.gather(*(get(base_url + path, timeout_s) for path in paths))
    return dict(zip(paths, answers, strict=True))


def served_model(models: Any) -> tuple[str | None, int | None]:
    """(id, max_model_len) of `GET /v1/models`'s data[0] (vLLM, SGLang), None where absent."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None, None
    name = data[0].get("id")
    return (name if isinstance(name, str) else None), tokens_or_none(data[0].get("max_model_len"))


def first_sse_event(body: bytes) -> Any:
    """The decoded JSON data of the first SSE event in `body`; None when there is none."""
    event = body.lstrip().split(b"\n\n", 1)[0]
    data = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
    return json_or_none(b"\n".join(data)) if data else None


def first_sse_error(body: bytes) -> Any:
    """The `error` of the first SSE event in `body` (`data: {"error": ...}`), or None when
    the first event is not an error (or not an SSE event at all)."""
    decoded = first_sse_event(body)
    return decoded.get("error") if isinstance(decoded, dict) else None


def error_code(error: Any) -> int | None:
    """The HTTP-like code an OpenAI-style error object carries (`{"code": 503, ...}`)."""
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


BUSY_STATUSES = (429, 503)


def busy_answer(status: int, body: bytes) -> bool:
    """The rule most kinds share: 429 or 503, or a 200 stream whose first event is an error
    carrying 429 or 503. Any other error (a 400 for a bad request, a 500) is not busy: it
    would fail the same way on every replica."""
    if status in BUSY_STATUSES:
        return True
    return status == 200 and error_code(first_sse_error(body)) in BUSY_STATUSES


async def post_json(post: Poster, url: str, payload: Any, timeout_s: float) -> Any:
    """The JSON of a 200 answer to POST `url`; None on any other status or when it could
    not be had. The client is imported here so that importing an adapter stays cheap."""
    from workers.api.client import UpstreamError, WorkerUnavailable

    try:
        status, answer = await post(url, payload, timeout_s)
    except (UpstreamError, WorkerUnavailable):
        return None
    return answer if status == 200 else None


def plausible_count(count: Any, body: dict[str, Any]) -> int | None:
    """A prompt count no larger than the request could produce: one token per byte of its
    JSON plus a template's special tokens. Anything else is None."""
    tokens = count_or_none(count)
    if tokens is None:
        return None
    limit = len(json.dumps(body, ensure_ascii=False).encode()) + _TEMPLATE_SLACK_TOKENS
    return tokens if tokens <= limit else None


def prompt_of(body: dict[str, Any]) -> tuple[list[Any] | None, str | None, list[int] | None]:
    """(messages, text prompt, token-id prompt) of an OpenAI body; at most one is set."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return messages, None, None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return None, prompt, None
    if isinstance(prompt, list) and prompt and all(count_or_none(t) is not None for t in prompt):
        return None, None, prompt
    return None, None, None


def sources(answers: dict[str, tuple[int | None, bytes]], used: tuple[str, ...]) -> str:
    """`UpstreamLoad.source`: the endpoints of `used` that answered 200, e.g. "GET /metrics"."""
    return ", ".join(f"GET {path}" for path in used if answers.get(path, (None, b""))[0] == 200)


def not_ready_reason(path: str, status: int | None, body: bytes) -> str:
    """`UpstreamLoad.reason` for a readiness check that did not pass."""
    if status is None:
        return f"GET {path}: no answer"
    detail = ""
    decoded = json_or_none(body[:4096])
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        detail = " " + error["message"][:200]
    elif isinstance(error, str):
        detail = " " + error[:200]
    return f"GET {path}: {status}{detail}"


def not_ready(path: str, status: int | None, body: bytes) -> UpstreamLoad:
    """The probe's answer when the readiness check `path` did not answer 200: no answer is
    "unreachable" (the caller tells starting from lost), any other status "loading"."""
    reason = not_ready_reason(path, status, body)
    if status is None:
        return UpstreamLoad(state="unreachable", reason=reason)
    return UpstreamLoad(state="loading", reason=reason)
