"""One request's generation as an HTTP response: a whole JSON body or an SSE stream.

Failures keep to their request: when the engine fails this request alone
(RequestFailedError) or dies (EngineDeadError), a non-streaming request gets an
OpenAI-shaped 500/503 and a stream gets an in-band error event, then `[DONE]`.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec
from litestar import Request

from workers.api.types import ApiError
from workers.engine.async_engine import AsyncEngine, EngineDeadError
from workers.engine.outputs import RequestOutput
from workers.engine.request import Request as EngineRequest
from workers.errors import RequestFailedError
from workers.server.logprobs import ChoiceLogprobs
from workers.server.openai_format import ResponseBuilder
from workers.server.service import HANDOVER, WorkerService

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
# A drained worker's last event on a stream it hands over (`WorkerService.hand_over`): a
# resuming gateway continues the stream elsewhere; a client of the worker itself sees it.
HANDED_OVER = ApiError(
    503,
    "this worker is draining: the stream is handed over, to be resumed on another replica",
    type="server_error",
    code="handed_over",
)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def engine_error(exc: Exception, streaming: bool) -> ApiError:
    """The OpenAI-shaped error for a request the engine failed, or for a dead engine."""
    if isinstance(exc, RequestFailedError):
        return ApiError(
            500,
            f"the engine failed on this request: {exc}",
            type="server_error",
            code="request_failed",
        )
    where = " mid-stream" if streaming else ""
    return ApiError(
        500 if streaming else 503,
        f"the engine failed{where}: {exc}",
        type="server_error",
        code="engine_failed",
    )


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


class _TokenClock:
    """Inter-token latency, generated-token count and the worker's token rate."""

    def __init__(self, service: WorkerService) -> None:
        m = service.metrics
        self.service = service
        self.itl = m.itl.labels(m.model)
        self.gen = m.generation_tokens.labels(m.model)
        self.t_last: float | None = None

    def tokens(self, n: int) -> None:
        if not n:
            return
        now = time.monotonic()
        if self.t_last is not None:
            self.itl.observe(now - self.t_last)
        self.t_last = now
        self.gen.inc(n)
        self.service.record_tokens(n)


async def _run_one(
    engine: AsyncEngine, req: EngineRequest, clock: "_TokenClock", lps: ChoiceLogprobs | None
) -> tuple[str, RequestOutput]:
    """One sample to its end: its text and last output. Its logprobs (when asked for) go
    into `lps` step by step as they arrive, so the answer's end costs no walk over them."""
    texts: list[str] = []
    last: RequestOutput | None = None
    async for out in engine.generate(req):
        last = out
        texts.append(out.new_text)
        clock.tokens(len(out.new_token_ids))
        if lps is not None and out.logprobs:
            lps.add(out.logprobs, out.new_token_ids)
    assert last is not None
    return "".join(texts), last


async def collect(
    service: WorkerService,
    engine: AsyncEngine,
    reqs: list[EngineRequest],
    builder: ResponseBuilder,
) -> bytes:
    """Run a request's samples (n of them, the first one's prompt shared) to the end; the
    whole response body."""
    clock = _TokenClock(service)
    lps = [
        lp if r.params.logprobs is not None else None
        for r, lp in zip(reqs, builder.logprobs, strict=True)
    ]
    tasks = [
        asyncio.ensure_future(_run_one(engine, r, clock, lp))
        for r, lp in zip(reqs, lps, strict=True)
    ]
    try:
        results = await asyncio.gather(*tasks)
    except (RequestFailedError, EngineDeadError) as exc:
        raise engine_error(exc, streaming=False) from None
    finally:
        for t in tasks:
            t.cancel()
    choices, lasts = [], []
    for index, (req, (text, last), lp) in enumerate(zip(reqs, results, lps, strict=True)):
        _observe(service, req, last)
        choices.append(builder.choice(index, text, last, lp.value() if lp is not None else None))
        lasts.append(last)
    return msgspec.json.encode(builder.full(choices, lasts))


async def until_done_or_disconnect(request: Request, work: Awaitable[bytes]) -> bytes:
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


async def sse_stream(
    service: WorkerService,
    engine: AsyncEngine,
    reqs: list[EngineRequest],
    builder: ResponseBuilder,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The SSE events of a request's samples (chunks carry the choice index); closing the
    iterator aborts them in the engine."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, req: EngineRequest) -> None:
        try:
            async for out in engine.generate(req):
                queue.put_nowait((index, out))
        except (RequestFailedError, EngineDeadError) as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    clock = _TokenClock(service)
    first = [True] * len(reqs)
    lasts: dict[int, RequestOutput] = {}
    # A stream whose chunks name their tokens is one a resuming gateway can continue: a
    # drain past its grace hands it over rather than wait for its end.
    resumable = builder.token_ids and len(reqs) == 1
    if resumable:
        service.watch_handover(queue)
    try:
        while len(lasts) < len(reqs):
            if all(first):
                try:
                    got = await asyncio.wait_for(queue.get(), service.config.sse_heartbeat_s)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
            else:
                got = await queue.get()
            if got is HANDOVER:
                log.info("%s handed over after %d tokens", reqs[0].request_id,
                         reqs[0].num_output_tokens)  # fmt: skip
                yield sse(HANDED_OVER.body())
                yield DONE
                return
            index, item = got
            if isinstance(item, Exception):
                yield sse(engine_error(item, streaming=True).body())
                yield DONE
                return
            out: RequestOutput = item
            clock.tokens(len(out.new_token_ids))
            if out.new_token_ids or out.new_text or out.finished or first[index]:
                yield sse(builder.chunk(out.new_text, out, first[index], index))
                first[index] = False
            if out.finished:
                _observe(service, reqs[index], out)
                lasts[index] = out
        if include_usage:
            yield sse(builder.usage_chunk([lasts[i] for i in range(len(reqs))]))
        yield DONE
    finally:
        if resumable:
            service.unwatch_handover(queue)
        for t in tasks:
            t.cancel()


async def exit_when_idle(service: WorkerService) -> None:
    engine = service.engine
    while engine is not None and not engine.is_idle():
        await asyncio.sleep(0.05)
    log.info("drained: no request left; exiting")
    if service.on_drained is not None:
        service.on_drained()
