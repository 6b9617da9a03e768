"""The public request flow: authenticate, decode, plan, reserve, queue, dispatch, relay,
reconcile. After the reservation, a `Flight` owns the request and settles it once.

Refusals that happen before any token (quota, validation, a full queue, no replica) get
their real HTTP status, streaming or not. A stream that has waited longer than one
heartbeat interval for its first byte is committed (200, `: queued` comments), and
whatever fails after that is reported in-band.
"""

import asyncio
import logging
import time

import httpx
import msgspec
from litestar import Request, Response

from cascade.policy import should_escalate
from gateway.admission import DeadlineExceeded
from gateway.context import Gateway
from gateway.dispatch import send_attempt
from gateway.errors import deadline_error, error_response, to_api_error, upstream_error
from gateway.flight import Attempt, Flight, FlightStream
from gateway.intake import authenticate_key, decode, prepare, ratelimit_headers
from gateway.plan import Plan, charge, note_usage, upstream_body
from gateway.relay import DONE, StreamAborted, StreamTimeout, relay
from quota.errors import QuotaExceeded
from workers.api import ApiError, EventStream, Usage, parse_summary

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
            _log_access(*line, flight.charged_tokens if flight is not None else 0)


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
    key_id, tenant = await authenticate_key(gw, request)
    owner["tenant"] = tenant.tenant_id
    req = decode(await read_body(request, gw.config.body_timeout_s), chat, gw.config)
    if gw.router is not None:
        await gw.router.refresh()
    plan = prepare(gw, tenant, key_id, req, chat, request.headers.get("x-request-timeout"))
    labels[:] = [plan.pool, plan.route]
    if gw.learner is not None:
        gw.learner.on_plan(gw, plan, req)
    t_reserve = time.perf_counter()
    reservation, state = await gw.limiter.reserve(tenant, plan.request_id, plan.reserve_tokens)
    if gw.metrics is not None:
        now = time.perf_counter()
        gw.metrics.redis_latency.labels("reserve").observe(now - t_reserve)
        gw.metrics.overhead.labels(plan.pool).observe(now - arrived)
        if not reservation.checked:
            gw.metrics.redis_errors.labels("reserve").inc()
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
    flight.key_id = key_id
    flight.arrived_at = arrived
    owner["flight"] = flight
    flight.client_deadline = request.headers.get("x-request-timeout") is not None
    try:
        attempt = flight.attempt(plan.pool)
        if plan.stream:
            return await _stream_response(gw, request, flight, attempt, headers)
        return await _json_response(gw, request, flight, attempt, headers)
    except asyncio.CancelledError:
        flight.finish()
        raise
    except DeadlineExceeded as exc:
        flight.finish()
        return error_response(deadline_error(exc, flight.client_deadline, gw.rng), headers)
    except Exception as exc:
        flight.finish()
        return error_response(to_api_error(exc, gw.rng), headers)


def _path(plan: Plan) -> str:
    return "/v1/chat/completions" if plan.chat else "/v1/completions"


async def _open(
    gw: Gateway, flight: Flight, attempt: Attempt, body: bytes, stream: bool
) -> httpx.Response:
    """Wait for the attempt's turn, then send it (with retries across replicas)."""
    queued = time.monotonic()
    await attempt.lease.wait()
    if gw.metrics is not None:
        gw.metrics.queue_wait.labels(attempt.lease.pool.name).observe(time.monotonic() - queued)
    upstream = await send_attempt(
        gw.workers,
        attempt.lease,
        _path(flight.plan),
        body,
        stream=stream,
        attempts=gw.config.dispatch_attempts,
        retry_cap_s=gw.config.worker_retry_after_cap_s,
        rng=gw.rng,
    )
    flight.track(attempt, upstream)
    return upstream


async def _relayed_error(upstream: httpx.Response, headers: dict[str, str]) -> Response:
    """A worker's refusal of the request itself (4xx, 500), with its status."""
    content = await upstream.aread()
    return error_response(upstream_error(upstream.status_code, content), headers)


# -- streaming ------------------------------------------------------------------------------


async def _stream_response(
    gw: Gateway, request: Request, flight: Flight, attempt: Attempt, headers: dict[str, str]
) -> Response | EventStream:
    body = upstream_body(flight.req, flight.plan, gw.cache_salt(flight.plan.tenant_id))
    opening = asyncio.ensure_future(_open(gw, flight, attempt, body, stream=True))
    aborting = asyncio.ensure_future(flight.aborted.wait())
    try:
        done, _ = await asyncio.wait(
            {opening, aborting}, timeout=gw.config.sse_heartbeat_s, return_when="FIRST_COMPLETED"
        )
    except asyncio.CancelledError:
        opening.cancel()
        raise
    finally:
        aborting.cancel()
    if aborting in done and opening not in done:
        opening.cancel()
        raise flight.abort_error
    sse_headers = {**headers, "cache-control": "no-cache"}
    if not done:  # commit now: heartbeats while it waits, failures in-band
        events = _events_after(gw, flight, attempt, opening)
        return EventStream(FlightStream(flight, events), headers=sse_headers)
    upstream = opening.result()  # a refusal raises: the caller answers with its status
    if upstream.status_code != 200:
        response = await _relayed_error(upstream, headers)
        flight.finish()
        return response
    events = _relay_events(gw, flight, attempt, upstream)
    return EventStream(FlightStream(flight, events), headers=sse_headers)


async def _events_after(gw: Gateway, flight: Flight, attempt: Attempt, opening: asyncio.Future):
    aborting = asyncio.ensure_future(flight.aborted.wait())
    try:
        while not opening.done():
            done, _ = await asyncio.wait(
                {opening, aborting},
                timeout=gw.config.sse_heartbeat_s,
                return_when="FIRST_COMPLETED",
            )
            if aborting in done:
                yield _error_event(to_api_error(flight.abort_error, gw.rng), flight)
                return
            if not done:
                yield b": queued\n\n"
        try:
            upstream = opening.result()
        except DeadlineExceeded as exc:
            yield _error_event(deadline_error(exc, flight.client_deadline, gw.rng), flight)
            return
        except Exception as exc:
            yield _error_event(to_api_error(exc, gw.rng), flight)
            return
        if upstream.status_code != 200:
            content = await upstream.aread()
            yield _error_event(upstream_error(upstream.status_code, content), flight)
            return
        async for event in _relay_events(gw, flight, attempt, upstream):
            yield event
    finally:
        opening.cancel()
        aborting.cancel()


async def _relay_events(gw: Gateway, flight: Flight, attempt: Attempt, upstream: httpx.Response):
    plan = flight.plan
    first = True
    pool = attempt.lease.pool.name
    metrics = gw.metrics
    last_at, last_tokens = 0.0, 0
    try:
        async for event in relay(
            upstream,
            attempt,
            plan.wants_usage,
            plan.deadline,
            gw.config.stream_idle_timeout_s,
        ):
            yield event
            tokens = attempt.served.tokens_relayed
            if first and tokens:
                first = False
                last_at, last_tokens = time.monotonic(), tokens
                attempt.lease.pool.record_ttft(last_at - flight.started_at)
                if metrics is not None:
                    metrics.ttft.labels(pool).observe(time.perf_counter() - flight.arrived_at)
            elif tokens > last_tokens and metrics is not None:
                now = time.monotonic()
                gap = (now - last_at) / (tokens - last_tokens)
                for _ in range(min(tokens - last_tokens, 16)):
                    metrics.itl.labels(pool).observe(gap)
                last_at, last_tokens = now, tokens
    except StreamAborted:
        err = to_api_error(flight.abort_error, gw.rng)
        yield _usage_event(flight, attempt) + _error_event(err, flight)
    except (httpx.HTTPError, StreamTimeout) as exc:
        url = attempt.lease.worker.url if attempt.lease.worker else "?"
        log.warning("stream of %s from %s ended early: %r", plan.request_id, url, exc)
        if isinstance(exc, StreamTimeout) and exc.deadline and flight.client_deadline:
            err = ApiError(
                408, "the request's x-request-timeout passed mid-stream", code="request_timeout"
            )
        elif isinstance(exc, StreamTimeout):
            err = ApiError(504, str(exc), type="server_error", code="timeout")
        else:
            err = ApiError(
                502,
                "the model server failed mid-stream",
                type="server_error",
                code="upstream_failed",
            )
        yield _usage_event(flight, attempt) + _error_event(err, flight)


def _usage_event(flight: Flight, attempt: Attempt) -> bytes:
    """For a client that asked for usage, on a stream cut short: what it is charged."""
    plan, served = flight.plan, attempt.served
    if not plan.wants_usage or served.usage_completion_tokens is not None:
        return b""
    completion = charge(plan, served) - plan.prompt_tokens if served.accepted else 0
    prompt = plan.prompt_tokens if served.accepted else 0
    usage = Usage(prompt, completion, prompt + completion)
    chunk = {
        "id": plan.request_id,
        "object": "chat.completion.chunk" if plan.chat else "text_completion",
        "created": int(time.time()),
        "model": plan.pool,
        "choices": [],
        "usage": usage,
    }
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def _error_event(err: ApiError, flight: Flight | None = None) -> bytes:
    """An in-band error (then [DONE]); it is the status `flight` is recorded with."""
    if flight is not None:
        flight.status = err.status
    return b"data: " + msgspec.json.encode(err.body()) + b"\n\n" + DONE


# -- non-streaming ----------------------------------------------------------------------


async def _json_response(
    gw: Gateway, request: Request, flight: Flight, attempt: Attempt, headers: dict[str, str]
) -> Response:
    work = asyncio.ensure_future(_complete(gw, flight, attempt, headers))
    gone = asyncio.ensure_future(_disconnected(request))
    aborting = asyncio.ensure_future(flight.aborted.wait())
    try:
        done, _ = await asyncio.wait({work, gone, aborting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        aborting.cancel()
        if not work.done():
            work.cancel()  # the client left: closing the upstream aborts the work there
    try:
        if work not in done and aborting in done:
            flight.finish()
            return error_response(to_api_error(flight.abort_error, gw.rng), headers)
        if work not in done:
            # The client left while a worker held the request: it pays the prompt that
            # worker took in (the closed connection aborts the rest there).
            for a in flight.attempts:
                if a.upstream is None and a.lease.worker is not None and a.lease.tried:
                    a.served.accepted = True
            flight.finish()
            return error_response(ApiError(499, "client disconnected"), headers)
        return work.result()
    finally:
        flight.finish()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _complete(
    gw: Gateway, flight: Flight, attempt: Attempt, headers: dict[str, str]
) -> Response:
    plan = flight.plan
    escalate = plan.escalation is not None
    body = upstream_body(flight.req, plan, gw.cache_salt(plan.tenant_id), with_logprobs=escalate)
    upstream = await _open(gw, flight, attempt, body, stream=False)
    if upstream.status_code != 200:
        return await _relayed_error(upstream, headers)
    content = await upstream.aread()
    summary = parse_summary(content)
    if summary is not None:
        note_usage(attempt.served, summary.usage)
    if escalate:
        content = await _maybe_escalate(gw, flight, content, headers)
    elif gw.learner is not None:
        gw.learner.on_answer(gw, plan, flight.req, content)
    return Response(
        content=content, status_code=200, headers=headers, media_type="application/json"
    )


async def _maybe_escalate(gw: Gateway, flight: Flight, content: bytes, headers: dict) -> bytes:
    """Re-run on the large pool when the small model's answer is unsure (both attempts
    were reserved and are charged). The body to send, logprobs removed unless asked."""
    plan, router = flight.plan, gw.router
    small = msgspec.json.decode(content)
    answer = small
    if should_escalate(token_logprobs(small), plan.escalation):
        large = router.large_pool
        body = upstream_body(
            flight.req,
            plan,
            gw.cache_salt(plan.tenant_id),
            pool=large,
            with_logprobs=plan.client_logprobs,
        )
        try:
            attempt = flight.attempt(large)
            upstream = await _open(gw, flight, attempt, body, stream=False)
            if upstream.status_code == 200:
                large_content = await upstream.aread()
                summary = parse_summary(large_content)
                if summary is not None:
                    note_usage(attempt.served, summary.usage)
                answer = msgspec.json.decode(large_content)
                changed = answer_text(answer) != answer_text(small)
                router.metrics.escalations.labels("true" if changed else "false").inc()
                headers["x-switchyard-model"] = large
                headers["x-switchyard-route"] = "escalated"
                if gw.learner is not None:
                    gw.learner.on_escalation(gw, plan, flight.req, small, answer)
            else:
                log.warning("escalation of %s refused (%d)", plan.request_id, upstream.status_code)
        except Exception as exc:
            log.warning(
                "escalation of %s failed, keeping the small answer: %r", plan.request_id, exc
            )
    elif gw.learner is not None:
        gw.learner.on_answer(gw, plan, flight.req, content)
    if not plan.client_logprobs:
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
