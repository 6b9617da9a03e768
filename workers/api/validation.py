"""Bounds on one request, checked before anything reaches an engine. Pure: no torch.

A request that passes these checks cannot crash the engine with an out-of-range value,
and what it costs in CPU per token (stop strings, logprobs, message parts) is bounded.
The worker runs `check_body_size`, `check_json_depth` on the raw body, decodes it, then
`check_request`; the gateway runs the same with the pool's `vocab_size` and
`max_model_len` from `/load` (None when unknown: those checks are skipped).

Every refusal is `workers.api.types.ApiError(400 or 413)` naming the parameter.
"""

import re
from dataclasses import dataclass
from typing import Any, NoReturn

from workers.api.types import ApiError, ChatCompletionRequest, CompletionRequest

# What torch.Generator.manual_seed accepts: any value that fits in 64 bits, signed or not.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
# Bounds where the vocabulary size is unknown: token ids and top_k stay int32-sized.
_ID_CEILING = 2**31 - 1
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds on what costs memory or CPU in proportion to the request."""

    max_body_bytes: int = 8 * 1024 * 1024  # beyond: 413
    max_json_depth: int = 32  # nesting of arrays and objects; the top-level object is 1
    max_stop_strings: int = 4  # as OpenAI
    max_stop_string_chars: int = 256  # each stop string is searched at every token
    max_stop_token_ids: int = 256
    max_logprobs: int = 20  # `logprobs` (completions) and `top_logprobs` (chat)
    # n x max_tokens x (1 + top alternatives): log-probability entries one answer may hold
    # (each ~80 bytes of JSON, built as its tokens arrive). 2**17: n=16 with 20 alternatives
    # up to 390 tokens, or one sample with 20 alternatives up to 6,241 tokens.
    max_logprob_entries: int = 131072
    max_logit_bias: int = 300  # entries of `logit_bias` (as OpenAI)
    max_messages: int = 2048
    max_content_parts: int = 256  # per chat message
    max_prompt_token_ids: int = 262144
    max_cache_salt_chars: int = 256  # the salt is hashed into every prefix-cache block
    max_n: int = 16  # samples per request (each one a sequence in the engine)
    max_tools: int = 128
    min_priority: int = -(2**31)
    max_priority: int = 2**31 - 1


def _bad(param: str | None, message: str, status: int = 400, code: str | None = None) -> NoReturn:
    raise ApiError(status, message, param=param, code=code)


def _in_range(value: float, lo: float, hi: float) -> bool:
    return lo <= value <= hi  # False for NaN


def check_body_size(num_bytes: int, limits: RequestLimits) -> None:
    """413 when a body is larger than `limits.max_body_bytes`."""
    if num_bytes > limits.max_body_bytes:
        _bad(
            None,
            f"the request body ({num_bytes} bytes) is larger than {limits.max_body_bytes} bytes",
            413,
            "request_too_large",
        )


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte except brackets
_UNIFY = bytes.maketrans(b"{}", b"[]")


def check_json_depth(raw: bytes, max_depth: int) -> None:
    """400 when arrays and objects nest deeper than `max_depth`, before any JSON decoding.

    String contents (escapes included) are skipped, so brackets inside text do not count.
    C-speed passes only: at most `max_depth + 1` over the brackets of the body.
    """
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return
    brackets = _STRING.sub(b'""', raw).translate(_UNIFY, _NOT_BRACKETS)
    if brackets.count(b"[") <= max_depth:
        return
    # A pass drops the innermost pairs, so a balanced body of depth D is D - p deep after
    # p passes; what cannot pair up (invalid JSON) only makes that an upper bound. Passes
    # run at C speed; the Python walk goes over runs of brackets, once they are few.
    too_deep = b"[" * (max_depth + 1)  # a run of openers nests that deep by itself
    for passes in range(max_depth + 1):
        if too_deep in brackets:
            break
        if brackets.count(b"][") * 32 <= len(brackets):
            if passes + _deepest(brackets) <= max_depth:
                return
            break
        brackets = brackets.replace(b"[]", b"")
    _bad(None, f"the JSON body nests deeper than {max_depth} levels", code="json_too_deep")


def _deepest(brackets: bytes) -> int:
    depth = deepest = 0
    for run in re.finditer(rb"\[+|\]+", brackets):
        n = run.end() - run.start()
        # A stray closer ends a parse; counting from 0 again errs on the deep side.
        depth = depth + n if brackets[run.start()] == 0x5B else max(depth - n, 0)  # 0x5B: "["
        deepest = max(deepest, depth)
    return deepest


def check_request(
    req: CompletionRequest | ChatCompletionRequest,
    limits: RequestLimits | None = None,
    *,
    vocab_size: int | None,
    max_model_len: int | None,
    default_max_tokens: int | None = None,
) -> None:
    """400 naming the first parameter out of bounds; None when the request is servable.

    `vocab_size`: token ids must be below it. `max_model_len`: prompt plus output tokens
    must fit in it (text prompts are checked by the engine once tokenized).
    `default_max_tokens`: the output budget of a request that sets none (None: unknown,
    and the bound on log-probability entries waits for an explicit one).
    """
    limits = limits or RequestLimits()
    chat = getattr(req, "messages", None) is not None
    if chat:
        max_tokens, max_param = _chat_max_tokens(req)  # type: ignore[arg-type]
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            _bad("max_tokens", "max_tokens must be at least 1")
    _check_sampling(req, limits, vocab_size, max_tokens)
    if chat:
        _check_chat(req, limits)  # type: ignore[arg-type]
    else:
        _check_completion(req, limits, vocab_size)  # type: ignore[arg-type]
    _check_logprob_entries(req, limits, max_tokens or default_max_tokens, max_param, chat)
    if max_model_len is not None:
        _check_context(req, max_tokens, max_param, max_model_len)


def _chat_max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name)
        if value is not None and value < 1:
            _bad(name, f"{name} must be at least 1")
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def _check_sampling(req: Any, limits: RequestLimits, vocab: int | None, max_tokens: int | None):
    if not 1 <= req.n <= limits.max_n:
        _bad("n", f"n must be between 1 and {limits.max_n} (got {req.n})")
    if req.temperature is not None and not _in_range(req.temperature, 0.0, 2.0):
        _bad("temperature", "temperature must be between 0 and 2")
    if req.top_p is not None and not (0.0 < req.top_p <= 1.0):
        _bad("top_p", "top_p must be in (0, 1]")
    if not _in_range(req.min_p, 0.0, 1.0):
        _bad("min_p", "min_p must be in [0, 1]")
    top_k_max = vocab if vocab is not None else _ID_CEILING
    if req.top_k not in (-1, 0) and not 1 <= req.top_k <= top_k_max:
        _bad("top_k", f"top_k must be -1 or 0 (off) or between 1 and {top_k_max}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not _in_range(getattr(req, name), -2.0, 2.0):
            _bad(name, f"{name} must be between -2 and 2")
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        _bad("seed", f"seed must fit in 64 bits: between {SEED_MIN} and {SEED_MAX}")
    if not limits.min_priority <= req.priority <= limits.max_priority:
        _bad(
            "priority",
            f"priority must be between {limits.min_priority} and {limits.max_priority}",
        )
    if req.min_tokens < 0:
        _bad("min_tokens", "min_tokens must be at least 0")
    if req.num_speculative_tokens is not None and req.num_speculative_tokens < 0:
        _bad("num_speculative_tokens", "num_speculative_tokens must be at least 0 (0 = off)")
    if max_tokens is not None and req.min_tokens > max_tokens:
        _bad("min_tokens", f"min_tokens ({req.min_tokens}) is above max_tokens ({max_tokens})")
    _check_stops(req, limits, vocab)
    _check_logit_bias(req.logit_bias, limits, vocab)
    if req.cache_salt is not None and len(req.cache_salt) > limits.max_cache_salt_chars:
        _bad("cache_salt", f"cache_salt is longer than {limits.max_cache_salt_chars} characters")


def _check_stops(req: Any, limits: RequestLimits, vocab: int | None) -> None:
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > limits.max_stop_strings:
        _bad("stop", f"at most {limits.max_stop_strings} stop strings are allowed")
    for s in stops:
        if not s:
            _bad("stop", "stop strings must not be empty")
        if len(s) > limits.max_stop_string_chars:
            _bad("stop", f"a stop string is longer than {limits.max_stop_string_chars} characters")
    ids = req.stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        _bad("stop_token_ids", f"at most {limits.max_stop_token_ids} stop token ids are allowed")
    _check_token_ids(ids, vocab, "stop_token_ids")


def _check_logit_bias(bias: dict[int, float] | None, limits: RequestLimits, vocab: int | None):
    if not bias:
        return
    if len(bias) > limits.max_logit_bias:
        _bad("logit_bias", f"logit_bias has {len(bias)} entries; at most {limits.max_logit_bias}")
    _check_token_ids(list(bias), vocab, "logit_bias")
    for token, value in bias.items():
        if not _in_range(value, -100.0, 100.0):
            _bad("logit_bias", f"logit_bias values must be between -100 and 100 (token {token})")


def _check_logprob_entries(
    req: Any, limits: RequestLimits, max_tokens: int | None, max_param: str, chat: bool
) -> None:
    """400 when an answer could hold more log-probability entries than the bound: each
    generated token of each sample carries its own and its top alternatives'."""
    if chat:
        top_param, top = "top_logprobs", req.top_logprobs or 0
        if not req.logprobs:
            return
    else:
        top_param, top = "logprobs", req.logprobs
        if top is None:
            return
    if max_tokens is None:
        return
    entries = req.n * max_tokens * (1 + top)
    if entries > limits.max_logprob_entries:
        _bad(
            top_param,
            f"n ({req.n}) x {max_param} ({max_tokens}) x (1 + {top_param} ({top})) = "
            f"{entries} log-probability entries, above this server's limit of "
            f"{limits.max_logprob_entries}: lower n, {max_param} or {top_param}",
            code="logprobs_too_large",
        )


def _check_token_ids(ids: list[int], vocab: int | None, param: str) -> None:
    ceiling = vocab if vocab is not None else _ID_CEILING + 1
    if any(not 0 <= t < ceiling for t in ids):
        _bad(param, f"{param} must be token ids in [0, {ceiling})")


def _check_completion(req: CompletionRequest, limits: RequestLimits, vocab: int | None) -> None:
    if req.logprobs is not None and not 0 <= req.logprobs <= limits.max_logprobs:
        _bad("logprobs", f"logprobs must be between 0 and {limits.max_logprobs}")
    prompt = req.prompt
    if isinstance(prompt, str):
        return
    if not prompt:
        _bad("prompt", "the prompt is empty")
    if all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            _bad("prompt", "only one prompt per request is supported")
        return
    if not all(isinstance(p, int) for p in prompt):
        _bad("prompt", "prompt must be a string, a list of token ids, or one string in a list")
    if len(prompt) > limits.max_prompt_token_ids:
        _bad("prompt", f"the prompt has more than {limits.max_prompt_token_ids} token ids")
    _check_token_ids(prompt, vocab, "prompt")  # type: ignore[arg-type]


def _check_chat(req: ChatCompletionRequest, limits: RequestLimits) -> None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            _bad("top_logprobs", "top_logprobs requires logprobs=true")
        if not 0 <= req.top_logprobs <= limits.max_logprobs:
            _bad("top_logprobs", f"top_logprobs must be between 0 and {limits.max_logprobs}")
    if req.tools is not None and len(req.tools) > limits.max_tools:
        _bad("tools", f"at most {limits.max_tools} tools are allowed")
    if not req.messages:
        _bad("messages", "messages must not be empty")
    if len(req.messages) > limits.max_messages:
        _bad("messages", f"at most {limits.max_messages} messages are allowed")
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            _bad("messages", f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}")
        if not isinstance(m.content, list):
            continue
        if len(m.content) > limits.max_content_parts:
            _bad("messages", f"messages[{i}] has more than {limits.max_content_parts} parts")
        for part in m.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                _bad("messages", f"messages[{i}]: only text content parts are supported")


def _check_context(req: Any, max_tokens: int | None, param: str, max_model_len: int) -> None:
    code = "context_length_exceeded"
    if max_tokens is not None and max_tokens >= max_model_len:
        _bad(
            param,
            f"{param}={max_tokens} leaves no room for a prompt in this model's context of "
            f"{max_model_len} tokens",
            code=code,
        )
    prompt = getattr(req, "prompt", None)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        total = len(prompt) + (max_tokens or 0)
        if len(prompt) >= max_model_len or total > max_model_len:
            _bad(
                "prompt" if len(prompt) >= max_model_len else param,
                f"This model's maximum context length is {max_model_len} tokens; the request "
                f"asks for {total} ({len(prompt)} in the prompt, {max_tokens or 0} to generate).",
                code=code,
            )
