"""Sending one attempt of a request to a pool: retries across replicas before any byte of
the answer reached the client, never after.

Retried on another replica (honouring its Retry-After, capped, with jitter): a worker
that could not be reached or did not start its answer in time, went unreachable or
stalled while a non-streaming answer was pending, or refused with a status in
`RETRYABLE_STATUSES` (overload, not the request's fault). Never retried: any other
answer, 4xx and 500 included, since those are about the request itself, and carrying a
request that breaks workers from replica to replica would break the whole pool.
"""

import asyncio
import logging
import random
import time

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_base

from gateway.capacity.admission import DeadlineExceeded
from gateway.capacity.lease import Lease
from workers.api.client import UpstreamResponse, WorkerClient, WorkerUnavailable

log = logging.getLogger(__name__)

RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})  # the worker's or its proxy's overload


class Refused(Exception):
    """A replica refused this try (or failed before answering); another may take it."""

    def __init__(self, message: str, retry_after_s: float = 0.05) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _WaitRetryAfter(wait_base):
    """Wait what the refusing worker asked (capped), plus jitter."""

    def __init__(self, cap_s: float, rng: random.Random) -> None:
        self.cap_s = cap_s
        self.rng = rng

    def __call__(self, retry_state) -> float:  # noqa: ANN001 (tenacity's RetryCallState)
        return self.after(retry_state.outcome.exception() if retry_state.outcome else None)

    def after(self, exc: BaseException | None) -> float:
        base = exc.retry_after_s if isinstance(exc, Refused) else 0.05
        return min(base, self.cap_s) * (1.0 + 0.5 * self.rng.random())


def _retry_after(r: UpstreamResponse) -> float:
    try:
        return float(r.headers.get("retry-after", "0.2"))
    except ValueError:
        return 0.2


async def send_attempt(
    client: WorkerClient,
    lease: Lease,
    path: str,
    body: bytes,
    *,
    stream: bool,
    attempts: int,
    retry_cap_s: float,
    rng: random.Random,
) -> UpstreamResponse:
    """The first answer that is not a refusal, with its status and headers read and its
    body unread (the caller reads or relays it, then closes it). The lease holds the slot
    of the worker that answered (`lease.worker`).

    Raises Refused when every try was refused, NoReplica when no replica has room, and
    DeadlineExceeded when the request's deadline passes first.
    """
    # The first try outside tenacity: most requests need no other, and setting up the
    # retry loop cost more CPU than the try (py-spy: ~5% of a plain request).
    try:
        return await _try_once(client, lease, path, body, stream)
    except Refused as exc:
        if attempts <= 1:
            raise
        wait = _WaitRetryAfter(retry_cap_s, rng)
        await asyncio.sleep(wait.after(exc))
    retrying = AsyncRetrying(
        stop=stop_after_attempt(attempts - 1),
        wait=wait,
        retry=retry_if_exception_type(Refused),
        reraise=True,
    )
    async for trying in retrying:
        with trying:
            return await _try_once(client, lease, path, body, stream)
    raise AssertionError("unreachable")


async def _try_once(
    client: WorkerClient, lease: Lease, path: str, body: bytes, stream: bool
) -> UpstreamResponse:
    view = lease.next_worker()
    pool = lease.pool
    remaining_s = lease.ticket.deadline - time.monotonic()
    if remaining_s <= 0:
        raise DeadlineExceeded(lease.ticket.request_id, lease.ticket.deadline, 0.0, "dispatch")
    lost = pool.lost(view.url)
    sending = asyncio.ensure_future(client.post(view.url, path, body, stream=stream))
    watching = lost
    try:
        done, _ = await asyncio.wait(
            {sending, watching}, timeout=remaining_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        if not sending.done():
            sending.cancel()
    if sending not in done:
        _close_later(sending)
        if watching in done:
            raise Refused(f"{view.url} went {view.state} before answering")
        raise DeadlineExceeded(
            lease.ticket.request_id, lease.ticket.deadline, remaining_s, "dispatch"
        )
    try:
        r = sending.result()
    except WorkerUnavailable as exc:
        pool.mark_unreachable(view.url)
        raise Refused(str(exc)) from exc
    if r.status_code in RETRYABLE_STATUSES:
        await r.aclose()
        raise Refused(f"{view.url} answered {r.status_code}", _retry_after(r))
    return r


def _close_later(task: "asyncio.Future[UpstreamResponse]") -> None:
    """A cancelled send may still have produced a response: close it so the connection
    goes back to the pool (and the worker sees the request abandoned)."""

    def done(t: "asyncio.Future[UpstreamResponse]") -> None:
        if not t.cancelled() and t.exception() is None:
            asyncio.ensure_future(t.result().aclose())

    task.add_done_callback(done)
