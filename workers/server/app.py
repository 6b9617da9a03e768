"""The worker's HTTP app (Litestar): OpenAI endpoints plus load, health, drain, metrics.

Handlers stay thin: bounds in `workers.api.validation`, decoding in `workers.api.types`, mapping in
`openai_format`, state and admission in `WorkerService`, responses in `generation`, and
generation itself in the engine thread. All errors leave through `_error_response`, in
the OpenAI shape. Control endpoints (/drain) are guarded by the worker's control key.
"""

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException
from litestar.handlers.base import BaseRouteHandler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from workers.api.sse import EventStream
from workers.api.types import ApiError, ChatCompletionRequest, CompletionRequest, decode_request
from workers.api.validation import check_body_size, check_json_depth, check_request
from workers.engine.async_engine import AsyncEngine
from workers.engine.request import Request as EngineRequest
from workers.engine.structured import GrammarSpec
from workers.errors import InvalidRequestError
from workers.server.openai_format import ResponseBuilder, chat_prompt, grammar_of, sampling_params
from workers.server.responses import collect, exit_when_idle, sse_stream, until_done_or_disconnect
from workers.server.service import WorkerService, bearer_matches
from workers.server.tools import plan_tools

log = logging.getLogger(__name__)


class DrainOptions(msgspec.Struct):
    exit_when_empty: bool | None = None  # None: the worker's `exit_when_drained`


def _error_response(exc: ApiError, service: WorkerService | None = None) -> Response:
    headers = {}
    if exc.retry_after_s is not None and service is not None:
        headers = service.retry_after_header(exc.retry_after_s)
    return Response(
        content=exc.body(), status_code=exc.status, headers=headers, media_type="application/json"
    )


def create_worker_app(service: WorkerService, on_startup: list[Callable] | None = None) -> Litestar:
    """The worker app around a service (its engine may still be loading)."""

    def api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(exc, service)

    def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return _error_response(ApiError(exc.status_code, str(exc.detail), type=kind, code=code))

    def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(ApiError(500, "internal error", type="server_error"))

    def requires_control_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        key = service.config.control_key
        if key is not None and not bearer_matches(connection.headers.get("authorization"), key):
            raise ApiError(
                401,
                "this endpoint needs the worker's control key (Authorization: Bearer <key>)",
                code="invalid_control_key",
            )

    def decode(raw: bytes, kind: type) -> Any:
        """Bounds first, then decoding, then every field against the model's real limits."""
        limits = service.config.limits
        check_body_size(len(raw), limits)
        check_json_depth(raw, limits.max_json_depth)
        body = decode_request(raw, kind)
        vocab, max_len = service.vocab_size, service.max_model_len
        check_request(body, limits, vocab_size=vocab, max_model_len=max_len)
        return body

    async def submit(
        request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool
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
        make = _make_engine_request
        args = (service, engine, prompt, params, body, chat, grammar)
        # A new schema compiles off the event loop (milliseconds, a second for the first).
        engine_req = await asyncio.to_thread(make, *args) if grammar else make(*args)
        reqs = [engine_req] + [
            e.fork(engine_req, f"{engine_req.request_id}-{i}", _sample_seed(params.seed, i))
            for i in range(1, body.n)
        ]
        engine = service.admit(engine_req.num_prompt_tokens)
        builder = ResponseBuilder(
            engine_req.request_id, body.model, chat, e.tokenizer, body.n, tools
        )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        headers = {"x-request-id": engine_req.request_id}
        if body.stream:
            stream = sse_stream(service, engine, reqs, builder, include_usage)
            return EventStream(stream, headers={**headers, "cache-control": "no-cache"})
        result = await until_done_or_disconnect(request, collect(service, engine, reqs, builder))
        return Response(content=result, headers=headers, media_type="application/json")

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Any:
        body = decode(await request.body(), CompletionRequest)
        return await submit(request, body, chat=False)

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request) -> Any:
        body = decode(await request.body(), ChatCompletionRequest)
        return await submit(request, body, chat=True)

    @get("/v1/models")
    async def models() -> dict[str, Any]:
        max_len = service.engine.engine.max_model_len if service.engine else None
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
    async def load() -> Response:
        return Response(content=msgspec.json.encode(service.load()), media_type="application/json")

    @get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @get("/ready")
    async def ready() -> Response:
        state = service.state
        return Response(content={"state": state}, status_code=200 if state == "ready" else 503)

    @post("/drain", status_code=200, guards=[requires_control_key])
    async def drain(request: Request) -> dict[str, Any]:
        raw = await request.body()
        check_json_depth(raw, service.config.limits.max_json_depth)
        opts = decode_request(raw, DrainOptions) if raw.strip() else DrainOptions()
        exit_when_empty = (
            service.config.exit_when_drained
            if opts.exit_when_empty is None
            else opts.exit_when_empty
        )
        service.draining = True
        log.info("draining (exit when empty: %s)", exit_when_empty)
        if exit_when_empty and service.on_drained is not None:
            asyncio.get_running_loop().create_task(exit_when_idle(service))
        return {"state": service.state}

    @get("/metrics")
    async def metrics() -> Response:
        return Response(
            content=generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    return Litestar(
        route_handlers=[completions, chat_completions, models, load, health, ready, drain, metrics],
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            Exception: server_error,
        },
        on_startup=on_startup or [],
        request_max_body_size=service.config.limits.max_body_bytes,
        logging_config=None,  # the process's own logging (`--log-level`, `--log-format`)
    )


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
    service, engine: AsyncEngine, prompt, params, body, chat: bool, grammar: GrammarSpec | None
) -> EngineRequest:
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
    try:
        return e.make_request(
            f"{prefix}-{uuid.uuid4().hex}",
            params=params,
            priority=body.priority,
            cache_salt=body.cache_salt,
            grammar=grammar,
            **kwargs,
        )
    except InvalidRequestError as exc:
        param = "messages" if chat and exc.param == "prompt" else exc.param
        raise ApiError(400, exc.message, param=param, code=exc.code) from None
