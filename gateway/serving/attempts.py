"""Sending one attempt of a flight: wait for its turn, dispatch it (with retries across
replicas), and keep the answer on the flight; a worker's refusal relayed with its status."""

import time

from litestar import Response

from gateway.errors import error_response, upstream_error
from gateway.gateway import Gateway
from gateway.serving.dispatch import send_attempt
from gateway.serving.flight import Attempt, Flight
from gateway.serving.plan import Plan
from workers.api.client import UpstreamResponse


def path_of(plan: Plan) -> str:
    return "/v1/chat/completions" if plan.chat else "/v1/completions"


async def open_attempt(
    gw: Gateway, flight: Flight, attempt: Attempt, body: bytes, stream: bool
) -> UpstreamResponse:
    """Wait for the attempt's turn, then send it (with retries across replicas)."""
    queued = time.monotonic()
    await attempt.lease.wait()
    if gw.metrics is not None:
        gw.metrics.queue_wait.labels(attempt.lease.pool.name).observe(time.monotonic() - queued)
    upstream = await send_attempt(
        gw.workers,
        attempt.lease,
        path_of(flight.plan),
        body,
        stream=stream,
        attempts=gw.config.dispatch_attempts,
        retry_cap_s=gw.config.worker_retry_after_cap_s,
        rng=gw.rng,
    )
    flight.track(attempt, upstream)
    return upstream


async def relayed_error(upstream: UpstreamResponse, headers: dict[str, str]) -> Response:
    """A worker's refusal of the request itself (4xx, 500), with its status."""
    content = await upstream.aread()
    return error_response(upstream_error(upstream.status_code, content), headers)
