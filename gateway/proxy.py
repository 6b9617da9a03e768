"""The public request flow: authenticate, validate, reserve tokens, queue, dispatch, relay,
reconcile. Every path that reserved tokens reconciles them exactly once."""

import asyncio
import logging
import time

import httpx
import msgspec
from litestar import Request, Response

from cascade.policy import should_escalate
from gateway.admission import Ticket
from gateway.context import Gateway
from gateway.errors import error_response, to_api_error
from gateway.intake import Prepared, authenticate_key, prepare, ratelimit_headers
from gateway.relay import Attempt, Dispatcher, WorkerRefused, relay_events
from quota.limiter import Reservation
from workers.api import ApiError, EventStream

log = logging.getLogger(__name__)


def _charge(prep: Prepared, attempt: Attempt, dispatched: bool) -> int:
    """Tokens to charge: the worker's usage; else the prompt plus what was generated once
    dispatched (a client that left after dispatch still pays its prompt); else nothing."""
    if attempt.usage_seen:
        return (attempt.prompt_tokens or prep.prompt_tokens) + attempt.completion_tokens
    return prep.prompt_tokens + attempt.completion_tokens if dispatched else 0


async def handle(gw: Gateway, request: Request, chat: bool) -> Response | EventStream:
    """One public request, counted by pool, route and status."""
    t0 = time.perf_counter()
    labels = ["-", "-"]
    status = 500
    try:
        response = await _handle(gw, request, chat, labels)
        status = response.status_code
        return response
    except Exception as exc:
        status = to_api_error(exc, gw.rng).status
        raise
    finally:
        if gw.metrics is not None:
            gw.metrics.requests.labels(labels[0], labels[1], str(status)).inc()
            if labels[0] != "-":
                gw.metrics.latency.labels(labels[0]).observe(time.perf_counter() - t0)


async def _handle(
    gw: Gateway, request: Request, chat: bool, labels: list[str]
) -> Response | EventStream:
    key_id, tenant = await authenticate_key(gw, request)
    if gw.router is not None:
        await gw.router.refresh()
    prep = prepare(
        gw, tenant, key_id, await request.body(), chat, request.headers.get("x-request-timeout")
    )
    labels[:] = [prep.pool, prep.route]
    cost = prep.prompt_tokens + prep.max_tokens
    reservation, state = await gw.limiter.reserve(tenant, prep.request_id, cost)
    headers = {
        "x-request-id": prep.request_id,
        "x-switchyard-model": prep.pool,
        "x-switchyard-route": prep.route,
        **ratelimit_headers(state),
    }
    if prep.score is not None:
        headers["x-switchyard-score"] = f"{prep.score:.4f}"
        headers["x-switchyard-threshold"] = f"{prep.threshold:.4f}"
    pool = gw.pools[prep.pool]
    ticket = Ticket(prep.request_id, tenant.tenant_id, cost, time.monotonic(), prep.deadline)
    admitted = asyncio.ensure_future(pool.admit(ticket, prep.affinity))
    if gw.metrics is not None:
        wait = gw.metrics.queue_wait.labels(prep.pool)
        admitted.add_done_callback(lambda _: wait.observe(time.monotonic() - ticket.enqueued_at))
    await asyncio.sleep(0)  # a full queue refuses at once, before any response starts
    if admitted.done() and admitted.exception() is not None:
        gw.reconcile_later(reservation, 0)
        return error_response(to_api_error(admitted.exception(), gw.rng), headers)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    payload = msgspec.json.encode(prep.body)
    if prep.stream:
        events = _stream(gw, prep, reservation, admitted, path, payload)
        return EventStream(events, headers={**headers, "cache-control": "no-cache"})
    return await _json(gw, prep, reservation, admitted, path, payload, headers)


async def _send_json(
    gw, pool_name: str, prep: Prepared, admitted, path, payload, charges
) -> httpx.Response:
    """Wait for the admission, send, and append what this attempt costs to `charges`."""
    attempt = Attempt()
    dispatched = False
    pool = gw.pools[pool_name]
    try:
        attempt.claimed = await admitted
        dispatched = True
        dispatcher = Dispatcher(
            pool, gw.config.dispatch_attempts, gw.config.worker_retry_after_cap_s, gw.rng
        )
        return await dispatcher.post_json(path, payload, prep.affinity, attempt)
    finally:
        _finish(pool, attempt, dispatched, admitted)
        charges.append(_charge(prep, attempt, dispatched))


async def _json(gw, prep, reservation, admitted, path, payload, headers) -> Response:
    charges: list[int] = []
    try:
        r = await _send_json(gw, prep.pool, prep, admitted, path, payload, charges)
        content = r.content
        if r.status_code == 200 and prep.escalation is not None:
            content = await _maybe_escalate(gw, prep, r.json(), path, headers, charges)
        return Response(
            content=content,
            status_code=r.status_code,
            headers=headers,
            media_type="application/json",
        )
    except (WorkerRefused, httpx.HTTPError) as exc:
        err = ApiError(
            503,
            f"no replica of {prep.pool} could serve the request: {exc}",
            type="server_error",
            code="upstream_unavailable",
            retry_after_s=1.0 + gw.rng.random(),
        )
        return error_response(err, headers)
    except Exception as exc:
        return error_response(to_api_error(exc, gw.rng), headers)
    finally:
        gw.reconcile_later(reservation, sum(charges))


async def _maybe_escalate(
    gw, prep: Prepared, small: dict, path: str, headers: dict, charges
) -> bytes:
    """Re-run on the large pool when the small model's answer is unsure; both attempts are
    charged. Returns the body to send (logprobs removed unless the client asked)."""
    router = gw.router
    answer = small
    if should_escalate(token_logprobs(small), prep.escalation):
        large = router.large_pool
        cost = prep.prompt_tokens + prep.max_tokens
        ticket = Ticket(
            prep.request_id + "-escalated",
            prep.tenant.tenant_id,
            cost,
            time.monotonic(),
            prep.deadline,
        )
        admitted = asyncio.ensure_future(gw.pools[large].admit(ticket, prep.affinity))
        body = {**prep.body, "model": large}
        if not prep.client_logprobs:
            body.pop("logprobs", None)
            body.pop("top_logprobs", None)
        try:
            r = await _send_json(
                gw, large, prep, admitted, path, msgspec.json.encode(body), charges
            )
        except (WorkerRefused, httpx.HTTPError) as exc:
            log.warning(
                "escalation of %s failed, keeping the small answer: %r", prep.request_id, exc
            )
            r = None
        if r is not None and r.status_code == 200:
            answer = r.json()
            changed = answer_text(answer) != answer_text(small)
            router.metrics.escalations.labels("true" if changed else "false").inc()
            headers["x-switchyard-model"] = large
            headers["x-switchyard-route"] = "escalated"
    if not prep.client_logprobs:
        for choice in answer.get("choices", []):
            choice["logprobs"] = None
    return msgspec.json.encode(answer)


def token_logprobs(body: dict) -> list[float]:
    """Chosen-token log-probabilities of the first choice (chat or completions shape)."""
    choice = (body.get("choices") or [{}])[0]
    lp = choice.get("logprobs") or {}
    if "content" in lp:
        return [t["logprob"] for t in lp["content"] or []]
    return [x for x in lp.get("token_logprobs") or [] if x is not None]


def answer_text(body: dict) -> str:
    choice = (body.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("message") or {}).get("content") or ""


async def _stream(gw, prep: Prepared, reservation: Reservation, admitted, path, payload):
    attempt = Attempt()
    dispatched = False
    pool = gw.pools[prep.pool]
    upstream = None
    try:
        while not admitted.done():
            done, _ = await asyncio.wait({admitted}, timeout=gw.config.sse_heartbeat_s)
            if not done:
                yield b": queued\n\n"
        try:
            attempt.claimed = admitted.result()
        except Exception as exc:
            yield _error_event(to_api_error(exc, gw.rng))
            return
        dispatched = True
        dispatcher = Dispatcher(
            pool, gw.config.dispatch_attempts, gw.config.worker_retry_after_cap_s, gw.rng
        )
        try:
            upstream = await dispatcher.open_stream(path, payload, prep.affinity, attempt)
        except (WorkerRefused, httpx.HTTPError) as exc:
            yield _error_event(
                ApiError(
                    503,
                    f"no replica of {prep.pool} could serve the request: {exc}",
                    type="server_error",
                    code="upstream_unavailable",
                )
            )
            return
        if upstream.status_code != 200:
            yield _error_event_raw(await upstream.aread())
            return
        try:
            async for event in relay_events(upstream, attempt, prep.wants_usage):
                yield event
        except httpx.HTTPError as exc:
            log.warning(
                "worker %s died mid-stream: %r", attempt.worker.url if attempt.worker else "?", exc
            )
            yield _error_event(
                ApiError(
                    502,
                    "the model server failed mid-stream",
                    type="server_error",
                    code="upstream_failed",
                )
            )
    finally:
        if upstream is not None:
            # Closing the connection is what tells the worker to abort; shielded because
            # a disconnecting client cancels this generator.
            try:
                await asyncio.shield(upstream.aclose())
            except asyncio.CancelledError:
                pass
        _finish(pool, attempt, dispatched, admitted)
        gw.reconcile_later(reservation, _charge(prep, attempt, dispatched))


def _finish(pool, attempt: Attempt, dispatched: bool, admitted: asyncio.Future) -> None:
    """Give back the worker slot (or the queue's turn) this request held."""
    if not admitted.done():
        admitted.cancel()  # still queued: leave the queue
    elif not dispatched and not admitted.cancelled() and admitted.exception() is None:
        attempt.claimed = admitted.result()  # admitted, but the client left first
        dispatched = True
    if attempt.worker is not None:
        pool.end(attempt.worker)
    elif attempt.claimed is not None:
        pool.end(attempt.claimed)
    elif dispatched and not attempt.tried:
        pool.controller.release()


def _error_event(err: ApiError) -> bytes:
    return b"data: " + msgspec.json.encode(err.body()) + b"\n\ndata: [DONE]\n\n"


def _error_event_raw(body: bytes) -> bytes:
    return b"data: " + body.strip() + b"\n\ndata: [DONE]\n\n"
