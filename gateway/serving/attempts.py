"""Sending one attempt of a flight: wait for its turn, dispatch it (with retries across
replicas), and keep the answer on the flight; a worker's refusal relayed with its status.

What a worker sends back is read as untrusted input: a body within the request's deadline
and a size bound (`answer_bytes`), an error body within a few KiB, and a status that is
not a success, a 4xx or a 5xx answered as a failure of the worker (502), never relayed.
"""

import asyncio
import time

from litestar import Response

from gateway.capacity.refusals import DeadlineExceeded
from gateway.errors import error_response, upstream_error
from gateway.gateway import Gateway
from gateway.serving.dispatch import send_attempt
from gateway.serving.flight import Attempt, Flight
from gateway.serving.plan import Plan
from workers.api.client import UpstreamResponse
from workers.api.types import ApiError

MAX_ERROR_BYTES = 65536  # an OpenAI error body is a few hundred bytes


def path_of(plan: Plan) -> str:
    return "/v1/chat/completions" if plan.chat else "/v1/completions"


def answer_bytes(gw: Gateway, flight: Flight) -> int:
    """The most a worker's answer to this request may take, a whole body or a stream's
    bytes in all: the configured floor, plus an allowance per token it may produce (its
    `n` samples' `max_tokens`, and the prompt again for each when it is echoed)."""
    plan, config = flight.plan, gw.config
    per_sample = plan.max_tokens + (plan.prompt_tokens if getattr(flight.req, "echo", False) else 0)
    return config.upstream_min_answer_bytes + config.upstream_bytes_per_token * plan.n * per_sample


async def open_attempt(
    gw: Gateway, flight: Flight, attempt: Attempt, body: bytes, stream: bool
) -> UpstreamResponse:
    """Wait for the attempt's turn, then send it (with retries across replicas)."""
    queued = time.monotonic()
    await attempt.lease.wait()
    if gw.metrics is not None:
        gw.metrics.queue_wait.labels(attempt.lease.pool.name).observe(time.monotonic() - queued)
    attempt.sent_at = time.monotonic()
    upstream = await dispatch(gw, flight, attempt, body, stream)
    flight.track(attempt, upstream)
    return upstream


async def dispatch(
    gw: Gateway, flight: Flight, attempt: Attempt, body: bytes, stream: bool
) -> UpstreamResponse:
    """Send `body` on the attempt's lease, with the gateway's retries across replicas (a
    lease that holds a failed worker's slot moves to one not tried yet)."""
    return await send_attempt(
        gw.workers,
        attempt.lease,
        path_of(flight.plan),
        body,
        stream=stream,
        attempts=gw.config.dispatch_attempts,
        retry_cap_s=gw.config.worker_retry_after_cap_s,
        rng=gw.rng,
        lost_after_s=gw.config.worker_lost_after_s,
    )


async def read_answer(upstream: UpstreamResponse, plan: Plan, max_bytes: int) -> bytes:
    """The worker's whole body, by the request's deadline and within `max_bytes`. Raises
    DeadlineExceeded, or UpstreamError (too large, or the connection broke)."""
    left_s = plan.deadline - time.monotonic()
    try:
        async with asyncio.timeout(max(left_s, 0.0)):
            return await upstream.aread(max_bytes)
    except TimeoutError:
        raise DeadlineExceeded(plan.request_id, plan.deadline, left_s, "dispatch") from None


def refusal_error(status: int, content: bytes) -> ApiError:
    """A worker's answer that is not a success: a 4xx or 5xx relayed with its status (the
    request's own fault, or an internal error of that request), anything else (a 2xx other
    than 200, a 3xx, a status past 599) a 502: the worker broke the contract."""
    if 400 <= status <= 599:
        return upstream_error(status, content)
    return ApiError(
        502,
        f"the model server answered with status {status}",
        type="server_error",
        code="upstream_failed",
    )


async def relayed_error(
    upstream: UpstreamResponse, plan: Plan, headers: dict[str, str]
) -> Response:
    """A worker's refusal of the request itself (4xx, 500), with its status."""
    content = await read_answer(upstream, plan, MAX_ERROR_BYTES)
    return error_response(refusal_error(upstream.status_code, content), headers)
