"""The public request flow: authenticate, decode, plan, reserve; then a `Flight` owns the
request and `gateway.serving.streaming` or `gateway.serving.completion` serves it (queue, dispatch,
relay), and the flight settles it once. Metrics and the access line are written here.

Refusals that happen before any token (quota, validation, a full queue, no replica) get
their real HTTP status, streaming or not.
"""

import asyncio
import logging
import time

from litestar import Request, Response

from gateway.capacity.admission import DeadlineExceeded
from gateway.errors import deadline_error, error_response, to_api_error
from gateway.gateway import Gateway
from gateway.serving.completion import json_response
from gateway.serving.flight import Flight
from gateway.serving.intake import (
    authenticate_caller,
    decode,
    key_quota_holder,
    prepare,
    ratelimit_headers,
)
from gateway.serving.plan import check_context
from gateway.serving.streaming import stream_response
from quota.errors import QuotaExceeded
from workers.api.sse import EventStream
from workers.api.types import ApiError

log = logging.getLogger(__name__)
access_log = logging.getLogger("gateway.access")


async def handle(gw: Gateway, request: Request, chat: bool) -> Response | EventStream:
    """One public request, counted by pool, route and status."""
    t0 = time.perf_counter()
    labels = ["-", "-"]
    status = 500
    owner: dict = {}  # "tenant", "flight": what the access line reports
    try:
        response = await _handle(gw, request, chat, labels, owner)
        status = response.status_code or 200  # a Stream's status is set when it is sent
        return response
    except asyncio.CancelledError:
        status = 499  # the client left before an answer began
        raise
    except Exception as exc:
        status = to_api_error(exc, gw.rng).status
        if isinstance(exc, QuotaExceeded) and gw.metrics is not None and "tenant" in owner:
            gw.metrics.quota_refusals.labels(gw.metrics.tenant(owner["tenant"]), exc.kind).inc()
        raise
    finally:
        if gw.metrics is not None:
            gw.metrics.requests.labels(labels[0], labels[1], str(status)).inc()
            if labels[0] != "-":
                gw.metrics.latency.labels(labels[0]).observe(time.perf_counter() - t0)
            if status == 503:
                gw.metrics.shed.labels(labels[0]).inc()
        flight = owner.get("flight")
        if flight is not None and flight.status is None:
            flight.status = status  # before its settlement runs (in a task not yet started)
        line = (request.url.path, owner.get("tenant", "-"), labels, status, t0)
        if flight is not None and not flight.finished:  # a stream: logged when it settles
            flight.on_finish = lambda: _log_access(*line, flight.charged_tokens)
        else:
            # After this task's step, i.e. once the answer is on its way: the line's format
            # and write are not on the request's path.
            tokens = flight.charged_tokens if flight is not None else 0
            asyncio.get_running_loop().call_soon(_log_access, *line, tokens)


def _log_access(
    path: str, tenant: str, labels: list[str], status: int, t0: float, tokens: int
) -> None:
    """One line per request: who, where to, how it ended; never prompt text or keys."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    latency_ms = round((time.perf_counter() - t0) * 1000)
    fields = {
        "path": path,
        "tenant": tenant,
        "model": labels[0],
        "route": labels[1],
        "status": status,
        "tokens": tokens,
        "latency_ms": latency_ms,
    }
    access_log.info(
        "%s tenant=%s model=%s route=%s status=%d tokens=%d latency_ms=%d",
        path,
        tenant,
        labels[0],
        labels[1],
        status,
        tokens,
        latency_ms,
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


async def _handle(
    gw: Gateway, request: Request, chat: bool, labels: list[str], owner: dict
) -> Response | EventStream:
    arrived = time.perf_counter()
    key_id, tenant, own_limits = await authenticate_caller(gw, request)
    owner["tenant"] = tenant.tenant_id
    req = decode(await read_body(request, gw.config.body_timeout_s), chat, gw.config)
    if gw.router is not None:
        await gw.router.refresh()
    plan = prepare(gw, tenant, key_id, req, chat, request.headers.get("x-request-timeout"))
    labels[:] = [plan.pool, plan.route]
    if own_limits is not None:
        check_context(plan.prompt_tokens, plan.max_tokens, own_limits.max_context, None)
    if gw.learner is not None:
        gw.learner.on_plan(gw, plan, req)
    t_reserve = time.perf_counter()
    reservation, state = await gw.limiter.reserve(tenant, plan.request_id, plan.reserve_tokens)
    key_reservation = None
    if own_limits is not None and key_id is not None:
        # The key's own limits: a second reservation under the key; refused, it leaves
        # nothing behind (the tenant's reservation is released, charged 0).
        try:
            key_reservation, key_state = await gw.limiter.reserve(
                key_quota_holder(tenant, key_id, own_limits), plan.request_id, plan.reserve_tokens
            )
        except BaseException:
            gw.reconcile_later(reservation, 0)
            raise
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
    flight = Flight(gw, plan, req, reservation)
    flight.key_reservation = key_reservation
    flight.key_id = key_id
    flight.arrived_at = arrived
    owner["flight"] = flight
    flight.client_deadline = request.headers.get("x-request-timeout") is not None
    try:
        attempt = flight.attempt(plan.pool)
        if plan.stream:
            return await stream_response(gw, flight, attempt, headers)
        return await json_response(gw, request, flight, attempt, headers)
    except asyncio.CancelledError:
        flight.finish()
        raise
    except DeadlineExceeded as exc:
        flight.finish()
        return error_response(deadline_error(exc, flight.client_deadline, gw.rng), headers)
    except Exception as exc:
        flight.finish()
        err = to_api_error(exc, gw.rng)
        if err.status == 500:  # not a domain error: a bug, so its traceback is logged
            log.exception("request %s failed", plan.request_id)
        return error_response(err, headers)
