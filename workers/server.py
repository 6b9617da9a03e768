"""The worker's HTTP app (Litestar): OpenAI endpoints plus load, health, drain, metrics.

Handlers stay thin: decoding and validation in `workers.api`/`openai_format`, state and
admission in `WorkerService`, generation in the engine thread. All errors leave through
`_error_response`, in the OpenAI shape.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from workers.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    EventStream,
    decode_request,
)
from workers.async_engine import AsyncEngine, EngineDeadError
from workers.engine import RequestOutput
from workers.errors import InvalidRequestError
from workers.openai_format import ResponseBuilder, chat_prompt, sampling_params
from workers.request import Request as EngineRequest
from workers.service import WorkerService

log = logging.getLogger(__name__)

_DONE = b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


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
        return _error_response(ApiError(exc.status_code, str(exc.detail), type=kind))

    def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(ApiError(500, "internal error", type="server_error"))

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
        if chat:
            if e.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer for chat", param="messages")
            prompt: str | list[int] = chat_prompt(body, e.tokenizer)
        else:
            prompt = _completion_prompt(body.prompt)
        engine_req = _make_engine_request(service, engine, prompt, params, body, chat)
        engine = service.admit(engine_req.num_prompt_tokens)
        builder = ResponseBuilder(engine_req.request_id, body.model, chat, e.tokenizer)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        headers = {"x-request-id": engine_req.request_id}
        if body.stream:
            stream = _sse_stream(service, engine, engine_req, builder, include_usage)
            return EventStream(stream, headers={**headers, "cache-control": "no-cache"})
        result = await _until_done_or_disconnect(
            request, _collect(service, engine, engine_req, builder)
        )
        return Response(content=result, headers=headers, media_type="application/json")

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Any:
        body = decode_request(await request.body(), CompletionRequest)
        return await submit(request, body, chat=False)

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request) -> Any:
        body = decode_request(await request.body(), ChatCompletionRequest)
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

    @post("/drain", status_code=200)
    async def drain(request: Request) -> dict[str, Any]:
        raw = await request.body()
        opts = msgspec.json.decode(raw) if raw else {}
        exit_when_empty = (
            bool(opts.get("exit_when_empty", service.config.exit_when_drained))
            if isinstance(opts, dict)
            else False
        )
        service.draining = True
        log.info("draining (exit when empty: %s)", exit_when_empty)
        if exit_when_empty and service.on_drained is not None:
            asyncio.get_running_loop().create_task(_exit_when_idle(service))
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
        request_max_body_size=8 * 1024 * 1024,
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


def _make_engine_request(
    service, engine: AsyncEngine, prompt, params, body, chat: bool
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
            **kwargs,
        )
    except InvalidRequestError as exc:
        param = "messages" if chat and exc.param == "prompt" else exc.param
        raise ApiError(400, exc.message, param=param, code=exc.code) from None


def _observe(service: WorkerService, req: EngineRequest, last: RequestOutput) -> None:
    reason = last.finish_reason.value if last.finish_reason else "abort"
    service.metrics.observe_finished(
        reason,
        req.num_prompt_tokens,
        req.arrival_time,
        req.first_scheduled_time,
        req.first_token_time,
        time.monotonic(),
    )


async def _collect(
    service: WorkerService, engine: AsyncEngine, req: EngineRequest, builder: ResponseBuilder
) -> bytes:
    texts: list[str] = []
    ids: list[int] = []
    lps = []
    last: RequestOutput | None = None
    itl = service.metrics.itl.labels(service.metrics.model)
    gen = service.metrics.generation_tokens.labels(service.metrics.model)
    t_last = None
    try:
        async for out in engine.generate(req):
            last = out
            texts.append(out.new_text)
            ids += out.new_token_ids
            if out.new_token_ids:
                now = time.monotonic()
                if t_last is not None:
                    itl.observe(now - t_last)
                t_last = now
                gen.inc(len(out.new_token_ids))
                service.record_tokens(len(out.new_token_ids))
            if out.logprobs:
                lps += out.logprobs
    except EngineDeadError as exc:
        raise ApiError(
            503, f"the engine failed: {exc}", type="server_error", code="engine_failed"
        ) from None
    assert last is not None
    _observe(service, req, last)
    logprobs = builder.logprobs(lps, ids) if req.params.logprobs is not None else None
    return msgspec.json.encode(builder.full("".join(texts), last, logprobs))


async def _until_done_or_disconnect(request: Request, work) -> bytes:
    """Run `work`; if the client disconnects first, cancel it (which aborts the request)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    raise ApiError(499, "client disconnected")


async def _sse_stream(
    service: WorkerService,
    engine: AsyncEngine,
    req: EngineRequest,
    builder: ResponseBuilder,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for out in engine.generate(req):
                queue.put_nowait(out)
        except EngineDeadError as exc:
            queue.put_nowait(exc)

    task = asyncio.ensure_future(pump())
    metrics = service.metrics
    itl = metrics.itl.labels(metrics.model)
    gen = metrics.generation_tokens.labels(metrics.model)
    first = True
    t_last = None
    try:
        while True:
            if first:
                try:
                    item = await asyncio.wait_for(queue.get(), service.config.sse_heartbeat_s)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
            else:
                item = await queue.get()
            if isinstance(item, EngineDeadError):
                err = ApiError(
                    500,
                    f"the engine failed mid-stream: {item}",
                    type="server_error",
                    code="engine_failed",
                )
                yield _sse(err.body())
                yield _DONE
                return
            out: RequestOutput = item
            if out.new_token_ids:
                now = time.monotonic()
                if t_last is not None:
                    itl.observe(now - t_last)
                t_last = now
                gen.inc(len(out.new_token_ids))
                service.record_tokens(len(out.new_token_ids))
            if out.new_token_ids or out.new_text or out.finished or first:
                yield _sse(builder.chunk(out.new_text, out, first))
                first = False
            if out.finished:
                _observe(service, req, out)
                if include_usage:
                    yield _sse(builder.usage_chunk(out))
                yield _DONE
                return
    finally:
        task.cancel()


async def _exit_when_idle(service: WorkerService) -> None:
    engine = service.engine
    while engine is not None and not engine.is_idle():
        await asyncio.sleep(0.05)
    log.info("drained: no request left; exiting")
    if service.on_drained is not None:
        service.on_drained()
