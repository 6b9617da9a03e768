"""Serving a streaming request: a stream is committed (200) only when a worker accepted
it, or after one heartbeat interval of waiting (then `: queued` comments, and whatever
fails after that is reported in-band). Refusals before that keep their HTTP status."""

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Response

from gateway.capacity.refusals import DeadlineExceeded
from gateway.errors import deadline_error, to_api_error
from gateway.gateway import Gateway
from gateway.serving.attempts import (
    MAX_ERROR_BYTES,
    answer_bytes,
    dispatch,
    open_attempt,
    read_answer,
    refusal_error,
    relayed_error,
)
from gateway.serving.flight import Attempt, Flight
from gateway.serving.plan import charge
from gateway.serving.relay import DONE, StreamAborted, StreamHandedOver, StreamTimeout, relay
from gateway.serving.resume import StreamLog, continuation, quoted, resumable
from quota.budget import NANOS
from workers.api.client import UpstreamError, UpstreamResponse
from workers.api.sse import EventStream
from workers.api.types import ApiError, Usage

logger = logging.getLogger("gateway.serving.handler")


async def stream_response(
    gw: Gateway, flight: Flight, attempt: Attempt, headers: dict[str, str]
) -> Response | EventStream:
    """The stream to send (its events relay the worker's answer while they are sent), or a
    refusal with its status. The attempt's dispatch runs as `attempt.opening`, which the
    flight's settlement cancels if it is still pending."""
    kind = attempt.lease.pool.kind
    cannot = resumable(flight.plan, kind, gw.config.stream_resumes)
    body = gw.body_for(flight.req, flight.plan, token_ids=cannot is None)
    log = StreamLog() if cannot is None else None
    opening = asyncio.ensure_future(open_attempt(gw, flight, attempt, body, stream=True))
    attempt.opening = opening
    aborting = flight.aborted
    # A request with a latest start (a TTFT target) is refused with its real status up to
    # then: the stream commits only once it could have started.
    wait_s = gw.config.sse_heartbeat_s
    start_by = attempt.lease.ticket.start_by
    if math.isfinite(start_by):
        wait_s += max(0.0, start_by - time.monotonic())
    done, _ = await asyncio.wait({opening, aborting}, timeout=wait_s, return_when="FIRST_COMPLETED")
    if aborting in done and opening not in done:
        raise flight.abort_error
    sse_headers = {**headers, "cache-control": "no-cache"}
    if not done:  # commit now: heartbeats while it waits, failures in-band
        return EventStream(
            _events_after(gw, flight, attempt, opening, _Resume(body, log)), headers=sse_headers
        )
    upstream = opening.result()  # a refusal raises: the caller answers with its status
    if upstream.status_code != 200:
        return await relayed_error(upstream, flight.plan, headers)
    return EventStream(
        _relay_events(gw, flight, attempt, upstream, _Resume(body, log)), headers=sse_headers
    )


class _Resume:
    """A stream's body and, when it is resumable, its log (`gateway.serving.resume`)."""

    __slots__ = ("body", "log")

    def __init__(self, body: bytes, log: StreamLog | None) -> None:
        self.body, self.log = body, log


async def _events_after(
    gw: Gateway,
    flight: Flight,
    attempt: Attempt,
    opening: "asyncio.Future[UpstreamResponse]",
    resume: _Resume,
) -> AsyncIterator[bytes]:
    aborting = flight.aborted
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
        try:
            content = await read_answer(upstream, flight.plan, MAX_ERROR_BYTES)
        except DeadlineExceeded as exc:
            yield _error_event(deadline_error(exc, flight.client_deadline, gw.rng), flight)
            return
        except UpstreamError as exc:
            yield _error_event(to_api_error(exc, gw.rng), flight)
            return
        yield _error_event(refusal_error(upstream.status_code, content), flight)
        return
    async for event in _relay_events(gw, flight, attempt, upstream, resume):
        yield event


async def _relay_events(
    gw: Gateway, flight: Flight, attempt: Attempt, upstream: UpstreamResponse, resume: _Resume
) -> AsyncIterator[bytes]:
    plan = flight.plan
    first = True
    pool = attempt.lease.pool.name
    metrics = gw.metrics
    arrived_at = flight.record.arrived_at
    last_at, last_tokens, first_at = 0.0, 0, 0.0
    log = resume.log
    while True:
        try:
            async for event in relay(
                upstream,
                attempt,
                plan,
                gw.config.stream_idle_timeout_s,
                answer_bytes(gw, flight),
                log,
                flight.cost_so_far if flight.prices else None,
            ):
                yield event
                tokens = attempt.served.tokens_relayed
                if first and tokens:
                    first = False
                    last_at, last_tokens = time.monotonic(), tokens
                    first_at = last_at
                    attempt.lease.pool.record_ttft(
                        last_at - flight.started_at, attempt.lease.ticket
                    )
                    attempt.first_token_s = time.perf_counter() - arrived_at
                    if flight.record.first_token_s is None:  # not a resumed stream's
                        flight.record.first_token_s = attempt.first_token_s
                        flight.record.predicted_ttft_s = attempt.lease.ticket.predicted_ttft_s
                    if metrics is not None:
                        metrics.ttft.labels(pool).observe(attempt.first_token_s)
                elif tokens > last_tokens:
                    now = time.monotonic()
                    gap = (now - last_at) / (tokens - last_tokens)
                    attempt.max_itl_s = max(attempt.max_itl_s, gap)  # for the pool's goodput
                    if metrics is not None:
                        for _ in range(min(tokens - last_tokens, 16)):
                            metrics.itl.labels(pool).observe(gap)
                    last_at, last_tokens = now, tokens
            if first_at and attempt.lease.worker is not None:  # it ran to its end
                attempt.lease.pool.record_service(
                    attempt.lease.worker.url,
                    attempt.served.usage_prompt_tokens or plan.prompt_tokens,
                    last_tokens,
                    first_token_s=first_at - attempt.sent_at,
                    decode_s=last_at - first_at,
                )
            return
        except StreamAborted:
            err = to_api_error(flight.abort_error, gw.rng)
            yield _usage_event(flight, attempt) + _error_event(err, flight)
            return
        except (UpstreamError, StreamTimeout) as exc:
            url = attempt.lease.worker.url if attempt.lease.worker else "?"
            log_line = "stream of %s from %s ended early: %r"
            if log is not None and _may_resume(gw, flight, exc, log):
                resumed = await _resume(gw, flight, attempt, resume, exc)
                if resumed is not None:
                    log.resumes += 1
                    flight.record.resumes = log.resumes
                    logger.warning(
                        log_line + "; resumed on %s after %d tokens",
                        plan.request_id,
                        url,
                        exc,
                        attempt.lease.worker.url if attempt.lease.worker else "?",
                        len(log.token_ids),
                    )
                    upstream = resumed
                    continue
            logger.warning(log_line, plan.request_id, url, exc)
            yield _usage_event(flight, attempt) + _error_event(
                _midstream_error(exc, flight), flight
            )
            return


def _may_resume(gw: Gateway, flight: Flight, exc: Exception, log: StreamLog) -> bool:
    """A failure the stream can go on from: the worker lost or silent (not the request's
    own deadline), every chunk relayed named its tokens, resumes left, the deadline not
    passed."""
    if isinstance(exc, StreamTimeout) and exc.deadline:
        return False
    if log.resumes >= gw.config.stream_resumes or not log.complete:
        return False
    return time.monotonic() < flight.plan.deadline


async def _resume(
    gw: Gateway, flight: Flight, attempt: Attempt, resume: _Resume, exc: Exception
) -> UpstreamResponse | None:
    """The continuation's stream from another replica (`gateway.serving.resume`), or None
    when none took it (then the stream ends in-band, as it would have)."""
    log = resume.log
    assert log is not None
    lease, failed = attempt.lease, attempt.upstream
    reason = (
        "idle" if isinstance(exc, StreamTimeout)
        else "drain" if isinstance(exc, StreamHandedOver)
        else "lost"
    )  # fmt: skip
    if lease.worker is not None:
        if reason == "drain":  # as its next /load will say: no more requests there
            lease.pool.note_reported(lease.worker, "draining")
        else:
            lease.pool.mark_unreachable(lease.worker.url)  # the load poll brings it back
    first_id = failed.headers.get("x-request-id") if failed is not None else None
    if failed is not None:
        failed.close()  # a stalled worker that wakes up aborts: nothing of it is relayed
    body = continuation(resume.body, log, flight.plan.chat)
    try:
        upstream = await dispatch(gw, flight, attempt, body, stream=True)
    except Exception as err:  # refused everywhere, no replica, the deadline: not resumed
        logger.warning("stream of %s could not be resumed: %r", flight.plan.request_id, err)
        return None
    flight.track(attempt, upstream)
    if upstream.status_code != 200:
        logger.warning(
            "stream of %s could not be resumed: %s answered %d",
            flight.plan.request_id,
            lease.worker.url if lease.worker else "?",
            upstream.status_code,
        )
        upstream.close()
        return None
    new_id = upstream.headers.get("x-request-id")
    first = log.rename[1] if log.rename is not None else quoted(first_id) if first_id else None
    if new_id and first:  # its chunks go out under the first stream's id
        log.rename = (quoted(new_id), first)
    if gw.metrics is not None:
        gw.metrics.resumes.labels(lease.pool.name, reason).inc()
    return upstream


def _midstream_error(exc: Exception, flight: Flight) -> ApiError:
    if isinstance(exc, StreamTimeout) and exc.deadline and flight.client_deadline:
        return ApiError(
            408, "the request's x-request-timeout passed mid-stream", code="request_timeout"
        )
    if isinstance(exc, StreamTimeout):
        return ApiError(504, str(exc), type="server_error", code="timeout")
    return ApiError(
        502, "the model server failed mid-stream", type="server_error", code="upstream_failed"
    )


def _usage_event(flight: Flight, attempt: Attempt) -> bytes:
    """For a client that asked for usage, on a stream cut short: what it is charged."""
    plan, served = flight.plan, attempt.served
    if not plan.wants_usage or served.usage_completion_tokens is not None:
        return b""
    completion = charge(plan, served) - plan.prompt_tokens if served.accepted else 0
    prompt = plan.prompt_tokens if served.accepted else 0
    usage: Any = Usage(prompt, completion, prompt + completion)
    if flight.prices:
        usage = {**msgspec.to_builtins(usage), "cost": flight.cost_so_far() / NANOS}
    chunk = {
        "id": plan.request_id,
        "object": "chat.completion.chunk" if plan.chat else "text_completion",
        "created": int(time.time()),
        "model": plan.pool,
        "choices": [],
        "usage": usage,
    }
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def _error_event(err: ApiError, flight: Flight) -> bytes:
    """An in-band error (then [DONE]); its status becomes the request's."""
    flight.record.status = err.status
    return b"data: " + msgspec.json.encode(err.body()) + b"\n\n" + DONE
