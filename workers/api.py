"""The worker's wire contract: request and report types, and a client for one worker.

This is the only module of `workers` that other packages import. Types are msgspec
Structs; decoding a request body with `decode_request` gives a typed object or an
`ApiError` naming the offending field.
"""

import re
from typing import Any, Literal

import msgspec
from litestar.response import Stream

WorkerState = Literal["loading", "ready", "draining", "stalled"]


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status, message, type, param, code, Retry-After."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class EventStream(Stream):
    """An SSE response. Litestar lets the handler's default media type win over a
    response's own, so this one insists on text/event-stream."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = "text/event-stream"
        return super().to_asgi_response(*args, **kwargs)


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions (OpenAI plus worker extras)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # Worker extras (DESIGN.md 3.2).
    priority: int = 0
    cache_salt: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[int | str]  # text, token ids, or a one-element list of text
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class LoadReport(msgspec.Struct):
    """`GET /load`: what the gateway routes on. Token counts in tokens."""

    state: WorkerState
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_free_tokens: int
    kv_total_tokens: int
    queued_prompt_tokens: int
    output_tokens_per_s: float  # over the last few seconds
    model: str
    max_model_len: int
    vocab_size: int | None = None  # token ids must be below it; None: unknown (external server)


_PATH = re.compile(r"at `\$\.?([A-Za-z_][\w]*)")
_MISSING = re.compile(r"missing required field `(\w+)`")


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode and type-check a JSON body; ApiError(400) naming the bad field."""
    if not body:
        raise ApiError(400, "the request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc)) or _MISSING.search(str(exc))
        raise ApiError(400, str(exc), param=match.group(1) if match else None) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
