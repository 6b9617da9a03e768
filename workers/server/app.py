"""The worker's HTTP app (Litestar): OpenAI endpoints plus load, health, drain, metrics.

Handlers are module-level functions over the `WorkerService`, which Litestar injects
(`service: ServiceDep`, from the app's state). They stay thin: bounds in
`workers.api.validation`, decoding in `workers.api.types`, mapping in `openai_format`,
state and admission in `WorkerService`, responses in `responses`, and generation itself
in the engine thread. Errors leave through the exception handlers below, in the OpenAI
shape: `ApiError` as it is, the engine's `InvalidRequestError` as a 400 naming the field,
its `GrammarBusyError` (a tenant's schema compiles at their bound) as a 429.
Control endpoints (/drain) are guarded by the worker's control key.
"""

import asyncio
import logging
import math
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.exceptions import HTTPException
from litestar.handlers.base import BaseRouteHandler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from workers.api.sse import EventStream
from workers.api.types import ApiError, ChatCompletionRequest, CompletionRequest, decode_request
from workers.api.validation import check_body_size, check_json_depth, check_request
from workers.engine.async_engine import AsyncEngine
from workers.engine.grammar_cache import GrammarBusyError
from workers.engine.request import Request as EngineRequest
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import GrammarSpec, Guide
from workers.errors import InvalidRequestError
from workers.server.openai_format import ResponseBuilder, chat_prompt, grammar_of, sampling_params
from workers.server.responses import collect, exit_when_idle, sse_stream, until_done_or_disconnect
from workers.server.service import (
    WorkerService,
    bearer_matches,
    jittered_retry_after,
    retry_after_headers,
)
from workers.server.tools import plan_tools

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"

# What a handler declares to be given the app's service (from its state, once per request).
ServiceDep = NamedDependency[WorkerService]


class DrainOptions(msgspec.Struct):
    exit_when_empty: bool | None = None  # None: the worker's `exit_when_drained`
    # Seconds before resumable streams are handed over; null: never; absent: the
    # worker's `drain_grace_s`.
    grace_s: float | None | msgspec.UnsetType = msgspec.UNSET


def create_worker_app(service: WorkerService, on_startup: list[Callable] | None = None) -> Litestar:
    """The worker app around a service (its engine may still be loading)."""
    return Litestar(
        route_handlers=[completions, chat_completions, models, load, health, ready, drain, metrics],
        dependencies={"service": Provide(_provide_service, sync_to_thread=False)},
        state=State({"service": service}),
        exception_handlers={
            ApiError: _api_error,
            InvalidRequestError: _invalid_request,
            GrammarBusyError: _grammar_busy,
            HTTPException: _http_error,
            Exception: _server_error,
        },
        on_startup=on_startup or [],
        request_max_body_size=service.config.limits.max_body_bytes,
        logging_config=None,  # the process's own logging (`--log-level`, `--log-format`)
    )


def _provide_service(state: State) -> WorkerService:
    return state.service


# -- guards ---------------------------------------------------------------------------


def requires_control_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    key = connection.app.state.service.config.control_key
    if key is not None and not bearer_matches(connection.headers.get("authorization"), key):
        raise ApiError(
            401,
            "this endpoint needs the worker's control key (Authorization: Bearer <key>)",
            code="invalid_control_key",
        )


# -- handlers -------------------------------------------------------------------------


@post("/v1/completions", status_code=200)
async def completions(request: Request, service: ServiceDep) -> Any:
    body = _decode(service, await request.body(), CompletionRequest)
    return await _submit(service, request, body, chat=False)


@post(CHAT_PATH, status_code=200)
async def chat_completions(request: Request, service: ServiceDep) -> Any:
    body = _decode(service, await request.body(), ChatCompletionRequest)
    return await _submit(service, request, body, chat=True)


@get("/v1/models")
async def models(service: ServiceDep) -> dict[str, Any]:
    max_len = service.max_model_len
    names = service.config.served_model_names or [service.model_name]
    data = [
        {
            "id": n,
            "object": "model",
            "created": 0,
            "owned_by": "switchyard",
            "max_model_len": max_len,
        }
        for n in names
    ]
    return {"object": "list", "data": data}


@get("/load")
async def load(service: ServiceDep) -> Response:
    return Response(content=msgspec.json.encode(service.load()), media_type="application/json")


@get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/ready")
async def ready(service: ServiceDep) -> Response:
    state = service.state
    return Response(content={"state": state}, status_code=200 if state == "ready" else 503)


@post("/drain", status_code=200, guards=[requires_control_key])
async def drain(request: Request, service: ServiceDep) -> dict[str, Any]:
    raw = await request.body()
    check_json_depth(raw, service.config.limits.max_json_depth)
    opts = decode_request(raw, DrainOptions) if raw.strip() else DrainOptions()
    exit_when_empty = (
        service.config.exit_when_drained if opts.exit_when_empty is None else opts.exit_when_empty
    )
    grace = service.config.drain_grace_s if opts.grace_s is msgspec.UNSET else opts.grace_s
    if grace is not None and not (grace >= 0 and math.isfinite(grace)):
        raise ApiError(400, f"grace_s must be a number >= 0 or null, got {grace}", param="grace_s")
    if not service.draining and grace is not None:
        asyncio.get_running_loop().call_later(grace, service.hand_over)
    if not service.draining:
        service.draining = True
        for listener in service.drain_listeners:
            listener()
    log.info(
        "draining (exit when empty: %s; resumable streams handed over after: %s)",
        exit_when_empty,
        "never" if grace is None else f"{grace:g} s",
    )
    if exit_when_empty and service.on_drained is not None:
        asyncio.get_running_loop().create_task(exit_when_idle(service))
    return {"state": service.state}


@get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    return Response(
        content=generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


# -- exception handlers: the one place errors become responses -----------------------


def _error_response(exc: ApiError) -> Response:
    headers = retry_after_headers(exc.retry_after_s) if exc.retry_after_s is not None else {}
    return Response(
        content=exc.body(), status_code=exc.status, headers=headers, media_type="application/json"
    )


def _api_error(request: Request, exc: ApiError) -> Response:
    return _error_response(exc)


def _invalid_request(request: Request, exc: InvalidRequestError) -> Response:
    """The engine refused the request as given: 400 naming the field (on the chat
    endpoint the prompt is the `messages`)."""
    param = exc.param
    if param == "prompt" and request.scope["path"] == CHAT_PATH:
        param = "messages"
    return _error_response(ApiError(400, exc.message, param=param, code=exc.code))


def _grammar_busy(request: Request, exc: GrammarBusyError) -> Response:
    """The tenant has its bound of schema compiles in flight: 429 with Retry-After (its
    schemas already compiled are still served)."""
    service: WorkerService = request.app.state.service
    cfg = service.config
    service.metrics.rejected.labels(service.metrics.model, "grammar_compiles").inc()
    retry = jittered_retry_after(cfg.retry_after_s, cfg.retry_after_jitter_s, service.rng)
    return _error_response(
        ApiError(
            429, str(exc), type="rate_limit_error", code="too_many_compiles", retry_after_s=retry
        )
    )


def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = "request_too_large" if exc.status_code == 413 else None
    return _error_response(ApiError(exc.status_code, str(exc.detail), type=kind, code=code))


def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return _error_response(ApiError(500, "internal error", type="server_error"))


# -- a generation request, from its body to its response ------------------------------


def _decode(service: WorkerService, raw: bytes, kind: type) -> Any:
    """Bounds first, then decoding, then every field against the model's real limits."""
    limits = service.config.limits
    check_body_size(len(raw), limits)
    check_json_depth(raw, limits.max_json_depth)
    body = decode_request(raw, kind)
    vocab, max_len = service.vocab_size, service.max_model_len
    default = service.config.default_max_tokens
    check_request(body, limits, vocab_size=vocab, max_model_len=max_len, default_max_tokens=default)
    return body


async def _submit(
    service: WorkerService,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
) -> Response | EventStream:
    names = service.config.served_model_names
    if names and body.model not in names:
        raise ApiError(
            404,
            f"model {body.model!r} is not served here; try {names}",
            param="model",
            code="model_not_found",
        )
    params = sampling_params(body, service.config.default_max_tokens)
    engine = service.engine
    if engine is None:
        raise service.refuse("the model is still loading", "loading", "model_loading")
    e = engine.engine
    tools = None
    if chat:
        if e.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer for chat", param="messages")
        tools = plan_tools(body, e.tokenizer.chat_template)
        prompt: str | list[int] = chat_prompt(body, e.tokenizer, tools)
    else:
        prompt = _completion_prompt(body.prompt)
    grammar = grammar_of(body, tools)
    _check_resume(body)
    # A schema the tenant has compiled is a look-up and a copy (microseconds); a new one
    # compiles off the event loop (milliseconds to a second), in the compiler's build lane.
    guide = e.grammars.cached(grammar, body.cache_salt) if grammar and e.grammars else None
    make = _make_engine_request
    args = (service, engine, prompt, params, body, chat, grammar, guide)
    engine_req = await asyncio.to_thread(make, *args) if grammar and not guide else make(*args)
    reqs = [engine_req] + [
        e.fork(engine_req, f"{engine_req.request_id}-{i}", _sample_seed(params.seed, i))
        for i in range(1, body.n)
    ]
    engine = service.admit(engine_req.num_tokens)  # a resumed one prefills its output too
    texts = service.token_texts()
    builder = ResponseBuilder(
        engine_req.request_id,
        body.model,
        chat,
        texts,
        body.n,
        tools,
        resumed=engine_req.resumed_text if body.resume_token_ids else None,
        resumed_ids=body.resume_token_ids or (),
        token_ids=body.return_token_ids,
    )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    headers = {"x-request-id": engine_req.request_id}
    if body.stream:
        stream = sse_stream(service, engine, reqs, builder, include_usage)
        return EventStream(stream, headers={**headers, "cache-control": "no-cache"})
    result = await until_done_or_disconnect(request, collect(service, engine, reqs, builder))
    return Response(content=result, headers=headers, media_type="application/json")


def _check_resume(body: Any) -> None:
    """A resume (`resume_token_ids`) continues one streamed sample (its grammar's matcher
    and its tool-call reader going on from the output): what it cannot continue exactly is
    refused, naming what it has."""
    if not body.resume_token_ids and not body.resume_text_chars:
        return
    if not body.resume_token_ids:
        raise ApiError(400, "resume_text_chars needs resume_token_ids", param="resume_text_chars")
    for refused, what in (
        (not body.stream, "a stream"),
        (body.n != 1, "n = 1"),
    ):
        if refused:
            raise ApiError(400, f"a resumed request must have {what}", param="resume_token_ids")


def _completion_prompt(prompt: str | list[int | str]) -> str | list[int]:
    """Text, or token ids; a list holding one string is that string."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(p, int) for p in prompt):
        return prompt  # type: ignore[return-value]
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise ApiError(
        400, "prompt must be a string, a list of token ids, or one string in a list", param="prompt"
    )


def _sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed: its own stream, derived from the request's seed."""
    if seed is None:
        return None
    return seed + index if seed + index < 2**64 else seed - index


def _make_engine_request(
    service: WorkerService,
    engine: AsyncEngine,
    prompt: str | list[int],
    params: SamplingParams,
    body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
    grammar: GrammarSpec | None,
    guide: Guide | None,
) -> EngineRequest:
    """Tokenize and validate (InvalidRequestError, a 400 by the handler above)."""
    e = engine.engine
    if isinstance(prompt, str) and e.tokenizer is not None:
        limit = e.max_model_len * service.max_chars_per_token()
        if len(prompt) > limit:
            # Certainly too long: refuse without tokenizing megabytes of text.
            raise ApiError(
                400,
                f"the prompt ({len(prompt)} characters) is far beyond this model's context "
                f"of {e.max_model_len} tokens",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
    kwargs: dict[str, Any] = (
        # A rendered chat prompt holds its special tokens already.
        {"prompt": prompt, "add_special_tokens": not chat}
        if isinstance(prompt, str)
        else {"prompt_token_ids": prompt}
    )
    prefix = "chatcmpl" if chat else "cmpl"
    return e.make_request(
        f"{prefix}-{uuid.uuid4().hex}",
        params=params,
        priority=body.priority,
        # The gateway salts each tenant's prefix cache apart: the salt is the tenant, for
        # the scheduler's fair share of prefill (requests without one share one lane).
        tenant=body.cache_salt,
        cache_salt=body.cache_salt,
        grammar=grammar,
        guide=guide,
        resume_token_ids=body.resume_token_ids,
        resume_text_chars=body.resume_text_chars,
        **kwargs,
    )
