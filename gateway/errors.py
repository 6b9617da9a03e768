"""The one place where domain errors become HTTP responses (OpenAI error shape)."""

import math
import random
from datetime import UTC, datetime
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException

from gateway.capacity.lease import NoReplica
from gateway.capacity.provider import ProviderLimited
from gateway.capacity.refusals import DeadlineExceeded, OverCapacity, QueueFull
from gateway.serving.dispatch import Refused
from quota.budget import NANOS
from quota.errors import (
    BudgetExceeded,
    InvalidLimits,
    QuotaExceeded,
    QuotaUnavailable,
    TenantExists,
    TenantNotFound,
)
from workers.api.client import UpstreamError
from workers.api.types import ApiError, parse_error


def retry_headers(seconds: float) -> dict[str, str]:
    return {
        "Retry-After": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(int(seconds * 1000)),
    }


def jitter(seconds: float, rng: random.Random, spread_s: float = 1.0) -> float:
    """Spread refusals so clients refused together do not return together."""
    return seconds + rng.uniform(0.0, spread_s)


def to_api_error(exc: Exception, rng: random.Random) -> ApiError:
    """Map a domain error to an ApiError (status, OpenAI type/code, Retry-After)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, BudgetExceeded):
        resets = datetime.fromtimestamp(exc.resets_at_s, UTC).isoformat(timespec="seconds")
        return ApiError(
            429,
            f"this {exc.holder}'s {exc.period} budget is spent ({exc.spent_nanos / NANOS:.9g} "
            f"of {exc.limit / NANOS:.9g}; the request could cost more than the "
            f"{exc.remaining / NANOS:.9g} left); it resets at {resets}",
            type="insufficient_quota",
            code="budget_exceeded",
            retry_after_s=jitter(exc.retry_after_s, rng),
        )
    if isinstance(exc, QuotaExceeded):
        return ApiError(
            429,
            f"quota exceeded: {exc.kind} (limit {exc.limit}, remaining {exc.remaining})",
            type="insufficient_quota" if exc.code == "insufficient_quota" else "rate_limit_error",
            code=exc.code,
            retry_after_s=jitter(exc.retry_after_s, rng),
        )
    if isinstance(exc, QuotaUnavailable):
        return ApiError(
            503,
            "quota service unavailable",
            type="server_error",
            code="quota_unavailable",
            retry_after_s=jitter(exc.retry_after_s, rng),
        )
    if isinstance(exc, QueueFull):
        return ApiError(
            503,
            f"the queue is full ({exc.reason}); retry later",
            type="server_error",
            code="server_overloaded",
            retry_after_s=exc.retry_after_s,
        )
    if isinstance(exc, ProviderLimited):
        return ApiError(
            503,
            f"{exc}; retry after the Retry-After interval",
            type="server_error",
            code="upstream_rate_limited",
            retry_after_s=exc.retry_after_s,
        )
    if isinstance(exc, OverCapacity):
        return ApiError(
            503,
            f"{exc}; retry after the Retry-After interval",
            type="server_error",
            code="over_capacity",
            retry_after_s=exc.retry_after_s,
        )
    if isinstance(exc, DeadlineExceeded):
        return deadline_error(exc, client_set=False, rng=rng)
    if isinstance(exc, NoReplica | Refused):
        return ApiError(
            503,
            f"no replica could serve the request: {exc}",
            type="server_error",
            code="upstream_unavailable",
            retry_after_s=jitter(getattr(exc, "retry_after_s", 1.0), rng),
        )
    if isinstance(exc, UpstreamError):  # the worker's connection broke mid-answer
        return ApiError(
            502, "the model server failed mid-answer", type="server_error", code="upstream_failed"
        )
    if isinstance(exc, TenantNotFound):
        return ApiError(
            404, str(exc) or "unknown tenant", param="tenant_id", code="tenant_not_found"
        )
    if isinstance(exc, TenantExists):
        return ApiError(409, str(exc) or "tenant exists", param="tenant_id", code="tenant_exists")
    if isinstance(exc, InvalidLimits):
        return ApiError(400, str(exc), param=getattr(exc, "param", None), code="invalid_limits")
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return ApiError(exc.status_code, str(exc.detail), type=kind, code=code)
    return ApiError(500, "internal error", type="server_error")


def deadline_error(exc: DeadlineExceeded, client_set: bool, rng: random.Random) -> ApiError:
    """A passed deadline. Waiting in the queue behind others is overload: 503 with a
    jittered Retry-After. Otherwise the request was not servable in the time it had: the
    client's own budget (`x-request-timeout`) is 408, the gateway's default one 504."""
    if exc.stage == "queue":
        return ApiError(
            503,
            f"the request's deadline passed after {exc.waited_s:.2f} s in the queue",
            type="server_error",
            code="deadline_exceeded",
            retry_after_s=jitter(1.0, rng),
        )
    where = "before it could start" if exc.stage == "start" else "before the model answered"
    if client_set:
        return ApiError(
            408, f"the request's x-request-timeout passed {where}", code="request_timeout"
        )
    return ApiError(
        504, f"the request timed out {where}", type="server_error", code="request_timeout"
    )


def upstream_error(status: int, content: bytes) -> ApiError:
    """A worker's answer that is not a success and not retried (the request's own fault, or
    an internal error of that request): relayed with its status and, where it is
    OpenAI-shaped, its error."""
    info = parse_error(content)
    if info is None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return ApiError(status, f"the model server answered {status}", type=kind)
    return ApiError(status, info.message, type=info.type, param=info.param, code=info.code)


def error_response(err: ApiError, extra_headers: dict[str, str] | None = None) -> Response:
    headers = dict(extra_headers or {})
    if err.retry_after_s is not None:
        headers.update(retry_headers(err.retry_after_s))
    return Response(
        content=err.body(), status_code=err.status, headers=headers, media_type="application/json"
    )


def exception_handlers(rng: random.Random) -> dict[Any, Any]:
    import logging

    log = logging.getLogger("gateway")

    def handle(request: Request, exc: Exception) -> Response:
        err = to_api_error(exc, rng)
        if err.status >= 500 and not isinstance(
            exc,
            ApiError
            | QuotaUnavailable
            | QueueFull
            | OverCapacity
            | DeadlineExceeded
            | NoReplica
            | Refused
            | UpstreamError,
        ):
            log.exception("unhandled error on %s", request.url.path)
        return error_response(err)

    return {Exception: handle}
