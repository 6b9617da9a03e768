"""The worker's wire types: requests, reports, errors, and their decoders.

msgspec Structs and pure functions only (no Litestar, aiohttp or torch), shared by the
worker, the gateway and the fake backends. Decoding a request body with `decode_request`
gives a typed object or an `ApiError` naming the offending field.
"""

import re
from typing import Any, Literal

import msgspec

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


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`response_format`: plain text, any JSON object, or JSON matching a schema. The
    worker enforces the JSON kinds by constrained decoding."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by completions and chat completions (OpenAI plus worker extras).

    A field not declared here is refused (400 naming it), never dropped: an OpenAI field
    this server does not implement (`suffix`, `best_of`, `functions`, `audio`, ...) would
    otherwise be answered as if it had been honoured. Subclasses inherit the rule.
    """

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
    response_format: ResponseFormat | None = None
    # Token id -> bias added to its logit before sampling, in [-100, 100] (OpenAI's JSON
    # keys are strings of digits; msgspec decodes them as ints).
    logit_bias: dict[int, float] | None = None
    # Speculative decoding (n-gram prompt lookup, where the pool's engine has it): draft
    # tokens verified per step for this request, at most the pool's bound; 0 = off, None =
    # the pool's default. Changes speed only, never the output.
    num_speculative_tokens: int | None = None
    # Resuming a stream another replica began and lost (the gateway's, never a client's:
    # gateway/serving/resume.py): the output tokens it relayed, and how many characters of
    # their text the client has; the stream then carries on from there (no role chunk, no
    # text twice), its usage counting the whole output. `return_token_ids`: each stream
    # chunk's choice carries the `token_ids` it brings, so a resume knows them.
    resume_token_ids: list[int] | None = None
    resume_text_chars: int = 0
    return_token_ids: bool = False


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[int | str]  # text, token ids, or a one-element list of text
    logprobs: int | None = None
    echo: bool = False


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as generated


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a `tool` message: the call it answers


class FunctionDef(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool = True


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class ComputeSeconds(msgspec.Struct):
    """Engine time a request was charged, in seconds (the extension `usage.compute_seconds`).

    A Switchyard worker charges each request its share of every engine step it was in: its
    tokens in the step over the step's tokens, times the step's wall time (schedule to
    sample). `prefill_s` sums the steps in which its tokens were a prefill chunk (the
    chunk that samples the first token included, and the recompute after a preemption);
    `decode_s` those in which they were a decode. With n > 1, the samples' shares summed.
    Reported by the worker: untrusted, a reader bounds it before pricing on it.
    """

    prefill_s: float
    decode_s: float


class Usage(msgspec.Struct):
    """`usage`: token counts (OpenAI's), and where a Switchyard worker reports it, the
    extension `compute_seconds`.

    `compute_seconds` is UNSET when absent (left out of the JSON: the default, so every
    Usage built without it encodes as before) and None when sent as `null`; both mean "not
    reported" (another engine, or a usage the gateway built). `compute()` reads it as one.
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    compute_seconds: ComputeSeconds | None | msgspec.UnsetType = msgspec.UNSET

    def compute(self) -> ComputeSeconds | None:
        """The reported engine time; None when absent or null."""
        c = self.compute_seconds
        return c if isinstance(c, ComputeSeconds) else None


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
    # The capacity model (workers/engine/step_model.py); None/empty: not measured (still
    # learning, or an external server). `seats`: sequences the running batch may hold
    # within `itl_target_s`; `decode_step_s`: predicted seconds per output token with the
    # batch full; `prefill_tokens_per_s`: prompt tokens a step computes per second beside
    # the batch; `step_s`: recent mean step time, measured. `running_remaining`: output
    # tokens each running request may still generate (its max_tokens left);
    # `waiting_max_tokens`: each waiting request's max_tokens, in order (the prompt tokens
    # left of each are in queued_prompt_tokens, summed); `running_prefill_tokens`: prompt
    # tokens the running requests have yet to compute (chunked prefills under way).
    seats: int | None = None
    itl_target_s: float | None = None
    decode_step_s: float | None = None
    prefill_tokens_per_s: float | None = None
    step_s: float | None = None
    running_remaining: list[int] = []
    running_prefill_tokens: int = 0  # prompt tokens the running requests have yet to compute
    waiting_max_tokens: list[int] = []


class ErrorInfo(msgspec.Struct):
    message: str
    type: str = "server_error"
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    """Every error body, worker and gateway: `{"error": {...}}` (OpenAI shape)."""

    error: ErrorInfo


class StreamChunk(msgspec.Struct, kw_only=True):
    """One SSE `data:` event of a streaming response, as far as a relay reads it.

    The worker sends one chunk with choices per engine step that produced output (one
    token), then, when `stream_options.include_usage` is set, a last chunk with no choices
    and the usage; an error after the first token is an event with `error` instead.
    `choices` stay raw: a relay forwards the bytes it received and never re-encodes them.
    """

    choices: list[msgspec.Raw] = []
    usage: Usage | None = None
    error: ErrorInfo | None = None


class ResponseSummary(msgspec.Struct, kw_only=True):
    """A non-streaming completion body, as far as the gateway reads it (usage only)."""

    usage: Usage | None = None


_CHUNK_DECODER = msgspec.json.Decoder(StreamChunk)
_SUMMARY_DECODER = msgspec.json.Decoder(ResponseSummary)
_ERROR_DECODER = msgspec.json.Decoder(ErrorBody)


def parse_chunk(data: bytes) -> StreamChunk | None:
    """The chunk in an SSE `data:` payload (without the prefix); None when it is not one."""
    try:
        return _CHUNK_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def parse_summary(body: bytes) -> ResponseSummary | None:
    """The usage of a non-streaming response body; None when the body is not one."""
    try:
        return _SUMMARY_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def parse_error(body: bytes) -> ErrorInfo | None:
    """The error of an OpenAI-shaped error body; None when the body is not one."""
    try:
        return _ERROR_DECODER.decode(body).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


# msgspec names the field in "- at `$.field...`", a dict's key in "at `key` in `$.field`",
# a top-level unknown or missing field in "Object contains unknown field `name`".
_PATH = re.compile(r"(?:at|in) `\$\.([A-Za-z_]\w*)")
_TOP_FIELD = re.compile(r"^Object (missing required|contains unknown) field `([^`]+)`$")


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode and type-check a JSON body; ApiError(400) naming the bad field. A field the
    request type does not declare is refused (`unknown_field`), never dropped."""
    if not body:
        raise ApiError(400, "the request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        path = _PATH.search(message)
        top = None if path else _TOP_FIELD.match(message)
        if top is not None and top.group(1) == "contains unknown":
            name = top.group(2)
            raise ApiError(
                400,
                f"unknown or unsupported field `{name}`: this server does not implement it",
                param=name,
                code="unknown_field",
            ) from None
        param = path.group(1) if path else top.group(2) if top else None
        raise ApiError(400, message, param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
