"""Sending one attempt of a request to a pool: retries across replicas before any byte of
the answer reached the client, never after.

Retried on another replica (honouring its Retry-After, capped, with jitter): a worker
that could not be reached or did not start its answer in time, was lost while a
non-streaming answer was pending, or refused with a status in `RETRYABLE_STATUSES`
(overload, not the request's fault). Never retried: any other answer, 4xx and 500
included, since those are about the request itself, and carrying a request that breaks
workers from replica to replica would break the whole pool.

A slow worker is not a lost one. A worker is lost when it says it is stalled, or leaves
the pool as dead, or when the pool sees it unreachable and nothing at all (no poll
answer, no byte on any of its connections) came from it for `lost_after_s`. A worker
building a large answer, or sending another, keeps the requests it holds; a first-byte
timeout marks a worker unreachable for the others only when it was that silent too.
"""

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Mapping

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_base

from gateway.capacity.balancer import WorkerView
from gateway.capacity.lease import Lease
from gateway.capacity.pool import Pool
from gateway.capacity.refusals import DeadlineExceeded
from workers.api.client import UpstreamError, UpstreamResponse, WorkerClient, WorkerUnavailable
from workers.api.upstreams.registry import adapter_for

log = logging.getLogger(__name__)

RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})  # the worker's or its proxy's overload
FIRST_EVENT_MAX_BYTES = 65536  # a foreign stream's first event is read ahead up to this
LOST_AFTER_S = 5.0  # silence (no poll answer, no byte) after which an unreachable worker is lost


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


def _retry_after(r: UpstreamResponse, default_s: float = 0.2) -> float:
    """The worker's Retry-After in seconds: a finite, non-negative number, else
    `default_s` (an HTTP date, `nan`, `inf`, garbage or a negative number alike)."""
    try:
        value = float(r.headers.get("retry-after", default_s))
    except ValueError:
        return default_s
    return value if math.isfinite(value) and value >= 0 else default_s


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
    lost_after_s: float = LOST_AFTER_S,
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
        return await _try_once(client, lease, path, body, stream, lost_after_s)
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
            return await _try_once(client, lease, path, body, stream, lost_after_s)
    raise AssertionError("unreachable")


async def _try_once(
    client: WorkerClient, lease: Lease, path: str, body: bytes, stream: bool, lost_after_s: float
) -> UpstreamResponse:
    view = lease.next_worker()
    pool = lease.pool
    deadline = lease.ticket.deadline
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:
        raise DeadlineExceeded(lease.ticket.request_id, deadline, 0.0, "dispatch")
    sending = asyncio.ensure_future(_send(client, view, path, body, stream))
    try:
        while True:
            # The answer, raced against the pool's word that the worker is unreachable or
            # stalled; once it is unreachable, against its silence making it lost.
            lost = pool.lost(view.url)
            wait_s = deadline - time.monotonic()
            if lost.done():
                if _is_lost(pool, client, view.url, lost_after_s):
                    _close_later(sending)
                    raise Refused(f"{view.url} went {view.state} before answering")
                wait_s = min(wait_s, max(lost_after_s - client.quiet_s(view.url), 0.05))
            done, _ = await asyncio.wait(
                {sending} if lost.done() else {sending, lost},
                timeout=max(wait_s, 0.0),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if sending in done:
                break
            if time.monotonic() >= deadline:
                _close_later(sending)
                raise DeadlineExceeded(lease.ticket.request_id, deadline, remaining_s, "dispatch")
    finally:
        if not sending.done():
            sending.cancel()
    try:
        r = sending.result()
    except Refused:
        raise
    except WorkerUnavailable as exc:
        if exc.kind != "late" or client.quiet_s(view.url) >= lost_after_s:
            pool.mark_unreachable(view.url)  # not for a worker heard from lately: slow
        raise Refused(str(exc)) from exc
    if view.kind != "switchyard":
        pool.note_answer(view.url, r.status_code, r.headers)
    if r.status_code in RETRYABLE_STATUSES:
        await r.aclose()
        raise Refused(f"{view.url} answered {r.status_code}", _retry_after(r))
    return r


async def _send(
    client: WorkerClient, view: WorkerView, path: str, body: bytes, stream: bool
) -> UpstreamResponse:
    """Post one try. A foreign server may accept a stream (200) and then say in its first
    event that it is overloaded or still loading: that first event is read here, so such an
    answer is a refusal that another replica may take, and any other is handed on whole."""
    r = await client.post(view.url, path, body, stream=stream)
    if not stream or r.status_code != 200 or view.kind in ("switchyard", "auto"):
        return r
    return await _first_event(r, view)


async def _first_event(r: UpstreamResponse, view: WorkerView) -> UpstreamResponse:
    it = r.aiter_raw()
    head = b""
    try:
        while len(head) < FIRST_EVENT_MAX_BYTES:
            piece = await anext(it, None)
            if piece is None:
                break
            head += piece
            event = _first_data_event(head)
            if event is None:
                continue
            if b'"error"' in event and adapter_for(view.kind).overloaded(200, event):
                await r.aclose()
                raise Refused(f"{view.url} refused in its stream's first event")
            break
    except UpstreamError as exc:
        await r.aclose()
        raise Refused(f"{view.url} broke before its first event: {exc}") from exc
    return Replayed(r, head, it)


def _first_data_event(head: bytes) -> bytes | None:
    """The first whole `data:` event in `head` (SSE comments skipped); None: none yet."""
    for event in head.split(b"\n\n")[:-1]:
        event = event.strip(b"\r\n")
        if event.startswith(b"data:"):
            return event
    return None


class Replayed(UpstreamResponse):
    """An answer whose first bytes were read ahead (`_first_event`): they come first."""

    __slots__ = ("_inner", "_head", "_it")

    def __init__(self, inner: UpstreamResponse, head: bytes, it: AsyncIterator[bytes]) -> None:
        self._inner, self._head, self._it = inner, head, it

    @property
    def status_code(self) -> int:
        return self._inner.status_code

    @property
    def headers(self) -> Mapping[str, str]:
        return self._inner.headers

    async def aread(self, max_bytes: int = 64 << 20) -> bytes:
        pieces = [self._head]
        received = len(self._head)
        async for piece in self._it:
            received += len(piece)
            if received > max_bytes:
                self._inner.close()
                raise UpstreamError(f"a body over {max_bytes} bytes")
            pieces.append(piece)
        return b"".join(pieces)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        head, self._head = self._head, b""
        if head:
            yield head
        async for piece in self._it:
            yield piece

    @property
    def is_closed(self) -> bool:
        return self._inner.is_closed

    def close(self) -> None:
        self._inner.close()

    async def aclose(self) -> None:
        await self._inner.aclose()


def _is_lost(pool: Pool, client: WorkerClient, url: str, lost_after_s: float) -> bool:
    """The worker at `url` will not answer what it holds: it says it is stalled, it left
    the pool as dead, or the pool sees it unreachable and it has been silent for
    `lost_after_s`."""
    view = pool.views.get(url)
    if view is None or view.state == "stalled":
        return True
    return view.state == "unreachable" and client.quiet_s(url) >= lost_after_s


def _close_later(task: "asyncio.Future[UpstreamResponse]") -> None:
    """A cancelled send may still have produced a response: close it so the connection
    goes back to the pool (and the worker sees the request abandoned)."""

    def done(t: "asyncio.Future[UpstreamResponse]") -> None:
        if not t.cancelled() and t.exception() is None:
            asyncio.ensure_future(t.result().aclose())

    task.add_done_callback(done)
