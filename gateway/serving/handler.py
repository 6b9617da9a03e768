"""The public request flow, one function from arrival to the answer's last byte: intake
(authenticate, decode, plan) and the reservation, then a `Flight` owns the request inside
one `with` block, which settles it however the block is left; `gateway.serving.streaming`
or `gateway.serving.completion` make the answer, and it is sent from here. The request's
`RequestRecord` carries who it was, where it went and how it ended to the metrics and the
access line, written once, at the end.

Refusals that happen before any token (quota, validation, a full queue, no replica) get
their real HTTP status, streaming or not.
"""

import asyncio
import logging
import time
from typing import Any, Protocol

from litestar import Request, Response

from gateway.billing.budgets import plan_worst_case_nanos
from gateway.billing.spend import note_spend
from gateway.capacity.refusals import DeadlineExceeded
from gateway.errors import deadline_error, error_response, to_api_error
from gateway.gateway import Gateway
from gateway.serving.completion import json_response
from gateway.serving.flight import Flight
from gateway.serving.intake import (
    authenticate_caller,
    decode,
    prepare,
    ratelimit_headers,
)
from gateway.serving.record import RequestRecord
from gateway.serving.streaming import stream_response
from quota.errors import BudgetExceeded, QuotaExceeded
from workers.api.sse import EventStream
from workers.api.types import ApiError

log = logging.getLogger(__name__)
access_log = logging.getLogger("gateway.access")


async def _nothing(scope: Any, receive: Any, send: Any) -> None:
    pass


class _Sent(Response):
    """What `handle` returns once it has sent its answer itself: Litestar sends nothing."""

    def to_asgi_response(self, app: Any, request: Any, **_: Any) -> Any:
        return _nothing


SENT = _Sent(None)


class BodyEdge(Protocol):
    """Another API in front of the chat path (`serving/messages_edge.py`,
    `serving/responses_edge.py`): its body, read once the caller is authenticated, becomes
    the chat body served (the tenant is given, for state kept per tenant)."""

    async def chat_body(self, raw: bytes, tenant_id: str) -> bytes: ...


async def handle(
    gw: Gateway, request: Request, chat: bool, edge: BodyEdge | None = None
) -> Response:
    """Serve one public request, its answer sent through the request's ASGI `send` (a
    stream is relayed while its flight owns it); returns `SENT`. `edge`: the request's
    body is another API's, translated to a chat body by it."""
    record = RequestRecord(request.scope["path"], time.perf_counter())
    try:
        await _serve(gw, request, chat, record, edge)
    except asyncio.CancelledError:
        if record.status is None:
            record.status = 499  # the client left before an answer began
        raise
    except Exception:
        if record.status is None:  # failed sending its answer: nothing more can be sent
            record.status = 500
        raise
    finally:
        _observe(gw, record)
    return SENT


async def _serve(
    gw: Gateway, request: Request, chat: bool, record: RequestRecord, edge: BodyEdge | None
) -> None:
    try:
        flight = await _admit(gw, request, chat, record, edge)
    except Exception as exc:  # refused before anything was reserved
        await _send(_refusal(gw, exc, record), request)
        return
    with flight:
        response = await _answer(gw, request, flight)
        if isinstance(response, EventStream):  # its body is the relay: sent in the block
            await _send(response, request)
            return
    await _send(response, request)  # after settling: a slow reader holds no worker slot


async def _admit(
    gw: Gateway, request: Request, chat: bool, record: RequestRecord, edge: BodyEdge | None
) -> Flight:
    """Authenticate, decode, plan and reserve: the request's flight, not entered yet."""
    arrived = record.arrived_at
    key_id, tenant, key_holder = await authenticate_caller(gw, request)
    record.tenant, record.key_id = tenant.tenant_id, key_id
    raw = await read_body(request, gw.config.body_timeout_s)
    if edge is not None:
        raw = await edge.chat_body(raw, tenant.tenant_id)
    req = decode(raw, chat, gw.config)
    if gw.router is not None:
        await gw.router.refresh()
    await gw.prices.refresh()
    timeout_header = request.headers.get("x-request-timeout")
    plan = await prepare(
        gw,
        tenant,
        key_id,
        req,
        chat,
        timeout_header,
        body_bytes=len(raw),
        key_max_context=key_holder.limits.max_context if key_holder is not None else None,
    )
    record.pool, record.route = plan.pool, plan.route
    if gw.learner is not None:
        gw.learner.on_plan(gw, plan, req)
    prices = gw.prices.prices  # this request's, reserve to settlement (a change: later ones)
    cost = 0
    if prices:
        escalates_to = gw.router.large_pool if plan.escalation and gw.router else None
        cost = plan_worst_case_nanos(
            prices, plan.pool, plan.prompt_tokens, plan.max_tokens, plan.n, escalates_to
        )
    t_reserve = time.perf_counter()
    try:
        reservation, state = await gw.limiter.reserve(
            tenant, plan.request_id, plan.reserve_tokens, cost
        )
    except BudgetExceeded:
        if gw.metrics is not None:
            gw.metrics.budget_refusals.labels(gw.metrics.tenant(tenant.tenant_id)).inc()
        raise
    note_spend(gw, tenant, key_id, reservation)
    key_reservation = None
    if key_holder is not None and key_id is not None:
        # The key's own limits and budget: a second reservation under the key; refused, it
        # leaves nothing behind (the tenant's reservation is given back, charged 0).
        try:
            key_reservation, key_state = await gw.limiter.reserve(
                key_holder, plan.request_id, plan.reserve_tokens, cost
            )
        except BaseException as exc:
            if isinstance(exc, BudgetExceeded) and gw.metrics is not None:
                gw.metrics.budget_refusals.labels(gw.metrics.tenant(tenant.tenant_id)).inc()
            gw.reconcile_later(reservation, 0)
            raise
        note_spend(gw, key_holder, key_id, key_reservation, tenant_id=tenant.tenant_id)
        state = key_state if key_state.limit_tokens is not None else state
    reserved = time.perf_counter()
    if gw.metrics is not None:
        gw.metrics.redis_latency.labels("reserve").observe(reserved - t_reserve)
        gw.metrics.overhead.labels(plan.pool).observe(reserved - arrived)
        if not reservation.checked:
            gw.metrics.redis_errors.labels("reserve").inc()
    if gw.gate is not None:
        gw.gate.observe(tenant.tenant_id, reserved - arrived)
    headers = {
        "x-request-id": plan.request_id,
        "x-switchyard-model": plan.pool,
        "x-switchyard-route": plan.route,
        **ratelimit_headers(state),
    }
    if plan.score is not None:
        headers["x-switchyard-score"] = f"{plan.score:.4f}"
        headers["x-switchyard-threshold"] = f"{plan.threshold:.4f}"
    return Flight(
        gw,
        plan,
        req,
        reservation,
        record,
        headers,
        key_reservation=key_reservation,
        client_deadline=timeout_header is not None,
        prices=prices,
    )


async def _answer(gw: Gateway, request: Request, flight: Flight) -> Response | EventStream:
    """The flight's answer, a refusal or failure included (with the plan's headers)."""
    headers = flight.headers
    try:
        attempt = flight.attempt(flight.plan.pool)
        if flight.plan.stream:
            response = await stream_response(gw, flight, attempt, headers)
        else:
            response = await json_response(gw, request, flight, attempt, headers)
    except DeadlineExceeded as exc:
        response = error_response(deadline_error(exc, flight.client_deadline, gw.rng), headers)
    except Exception as exc:
        err = to_api_error(exc, gw.rng)
        if err.status == 500:  # not a domain error: a bug, so its traceback is logged
            log.exception("request %s failed", flight.plan.request_id)
        response = error_response(err, headers)
    flight.record.answer(response.status_code or 200)  # a stream's is set when it is sent
    return response


def _refusal(gw: Gateway, exc: Exception, record: RequestRecord) -> Response:
    """The answer to a request refused before its flight (no plan headers)."""
    err = to_api_error(exc, gw.rng)
    if err.status == 500 and not isinstance(exc, ApiError):
        log.exception("request to %s failed", record.path)
    if isinstance(exc, QuotaExceeded) and gw.metrics is not None and record.tenant != "-":
        gw.metrics.quota_refusals.labels(gw.metrics.tenant(record.tenant), exc.kind).inc()
    record.answer(err.status)
    return error_response(err)


async def _send(response: Response, request: Request) -> None:
    asgi = response.to_asgi_response(None, request)
    await asgi(request.scope, request.receive, request.send)


def _observe(gw: Gateway, record: RequestRecord) -> None:
    """The request's metrics and access line, once it has ended."""
    status = record.status
    metrics = gw.metrics
    if metrics is not None:
        metrics.requests.labels(record.pool, record.route, str(status)).inc()
        if record.pool != "-":
            answered = record.answered_at
            end = answered if answered is not None else time.perf_counter()
            metrics.latency.labels(record.pool).observe(end - record.arrived_at)
        if status == 503:
            metrics.shed.labels(record.pool).inc()
    _log_access(record)


def _log_access(record: RequestRecord) -> None:
    """One line per request: who, where to, how it ended; never prompt text or keys."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    latency_ms = round((time.perf_counter() - record.arrived_at) * 1000)
    fields = {
        "path": record.path,
        "tenant": record.tenant,
        "model": record.pool,
        "route": record.route,
        "status": record.status,
        "tokens": record.tokens,
        "latency_ms": latency_ms,
    }
    extra = ""
    if record.first_token_s is not None:  # a stream: when its first token came
        fields["ttft_ms"] = round(record.first_token_s * 1000)
        extra += f" ttft_ms={fields['ttft_ms']}"
        if record.predicted_ttft_s is not None:  # and when admission said it would
            fields["predicted_ttft_ms"] = round(record.predicted_ttft_s * 1000)
            extra += f" predicted_ttft_ms={fields['predicted_ttft_ms']}"
    if record.resumes:  # its stream went on on another replica (serving/resume.py)
        fields["resumes"] = record.resumes
        extra += f" resumes={record.resumes}"
    access_log.info(
        "%s tenant=%s model=%s route=%s status=%d tokens=%d latency_ms=%d%s",
        record.path,
        record.tenant,
        record.pool,
        record.route,
        record.status,
        record.tokens,
        latency_ms,
        extra,
        extra={"fields": fields},
    )


async def read_body(request: Request, timeout_s: float) -> bytes:
    """The whole request body, within `timeout_s` (a client trickling it is refused)."""
    try:
        return await asyncio.wait_for(request.body(), timeout_s)
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {timeout_s:g} s", code="timeout"
        ) from None
