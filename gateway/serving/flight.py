"""The owner of one request in the gateway, from its reservation to its reconcile.

A `Flight` holds the request's quota reservation and one `Attempt` per pool it is sent
to (an escalated request makes two). Each attempt has its own `Lease` (queue turn and
worker slot) and records what it was served. `finish` settles everything exactly once:
upstream connections closed (which tells a worker to abort unfinished work), leases
released (a completion recorded only for attempts a worker answered), and the
reservation reconciled to the sum of what every attempt is charged. It never awaits, so
it is safe from a cancelled task and from a generator's `finally`.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gateway.capacity.admission import Ticket
from gateway.capacity.lease import Lease
from gateway.serving.plan import Plan, PublicRequest, Served, charge
from quota.limiter import Reservation
from quota.usage import UsagePart
from workers.api.client import UpstreamResponse

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a settled request ended, for its usage record and metrics."""

    model: str  # the pool that answered (the last attempt a worker accepted)
    route: str  # the plan's route, or "escalated" when a second attempt answered
    status: int  # HTTP status, or the in-band error's; 499 for a client gone mid-answer
    latency_ms: int  # arrival to settlement
    parts: tuple[UsagePart, ...]  # tokens per attempt a worker accepted


@dataclass(slots=True)
class Attempt:
    lease: Lease
    served: Served = field(default_factory=Served)
    upstream: UpstreamResponse | None = None
    reading: "asyncio.Future | None" = None  # the relay's pending read (abort cancels it)


class Flight:
    def __init__(self, gw, plan: Plan, req: PublicRequest, reservation: Reservation) -> None:  # noqa: ANN001
        self.gw = gw
        self.plan = plan
        self.req = req
        self.reservation = reservation
        self.attempts: list[Attempt] = []
        self.finished = False
        self.started_at = time.monotonic()
        self.client_deadline = False  # the deadline is the client's (x-request-timeout)
        self.key_reservation: Reservation | None = None  # under the key's own limits
        self.abort_error: Exception | None = None  # why the gateway cut this request short
        # Done when the gateway cuts the request short: a plain future, so the serving
        # code waits on it beside its work without a task of its own.
        self.aborted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.on_finish: Callable[[], None] | None = None  # after settling (the access log)
        self.key_id: str | None = None  # the API key's id (usage by key)
        # The response's status, set by whoever answers (in-band errors override it);
        # read when the settlement runs, after the handler returned. None: not answered.
        self.status: int | None = None
        self.arrived_at = time.perf_counter()  # the handler sets the request's arrival
        self.latency_s: float | None = None  # arrival to settlement
        gw.flights.add(self)

    def attempt(self, pool_name: str) -> Attempt:
        """A new attempt on `pool_name`, queued at once: raises QueueFull or
        DeadlineExceeded before any response has started."""
        plan = self.plan
        suffix = f"-{len(self.attempts)}" if self.attempts else ""
        ticket = Ticket(
            plan.request_id + suffix,
            plan.tenant_id,
            plan.attempt_tokens,
            time.monotonic(),
            plan.deadline,
        )
        attempt = Attempt(Lease(self.gw.pools[pool_name], ticket, plan.affinity))
        self.attempts.append(attempt)
        attempt.lease.enqueue()
        return attempt

    def track(self, attempt: Attempt, upstream: UpstreamResponse) -> None:
        """The worker answered `attempt`: keep its response to close it at the end."""
        attempt.upstream = upstream
        attempt.served.accepted = upstream.status_code == 200
        if self.finished:  # the request ended while the answer was on its way
            self._close(upstream)

    @property
    def charged_tokens(self) -> int:
        return sum(charge(self.plan, a.served) for a in self.attempts)

    def abort(self, error: Exception) -> None:
        """Cut the request short (the gateway is shutting down): whoever serves it answers
        the client with `error`, in-band for a committed stream, then finishes."""
        if self.finished or self.abort_error is not None:
            return
        self.abort_error = error
        self.aborted.set_result(None)
        for a in self.attempts:
            if a.reading is not None and not a.reading.done():
                a.reading.cancel()

    def finish(self) -> None:
        """Close, release and reconcile, once."""
        if self.finished:
            return
        self.finished = True
        self.latency_s = time.perf_counter() - self.arrived_at
        self.gw.flights.discard(self)
        for a in self.attempts:
            if a.upstream is not None:
                self._close(a.upstream)
            a.lease.release(served=a.served.accepted)
        self.gw.reconcile_later(self.reservation, self.charged_tokens, self)
        if self.key_reservation is not None:  # the key's own windows: the same charge
            self.gw.reconcile_later(self.key_reservation, self.charged_tokens)
        if self.on_finish is not None:
            self.on_finish()

    def outcome(self) -> Outcome:
        """What the request used and how it ended (call after `finish`)."""
        plan = self.plan
        parts = []
        model, route = plan.pool, plan.route
        for i, a in enumerate(self.attempts):
            served = a.served
            if not served.accepted and served.usage_completion_tokens is None:
                continue
            model = a.lease.pool.name
            if i > 0:
                route = "escalated"
            total = charge(plan, served)
            prompt = served.usage_prompt_tokens
            prompt = plan.prompt_tokens if prompt is None else prompt
            parts.append(UsagePart(model, prompt, served.usage_cached_tokens, total - prompt))
        status = self.status if self.status is not None else 499
        if status == 200 and any(
            a.served.accepted and a.served.usage_completion_tokens is None for a in self.attempts
        ):
            status = 499  # the client left before the answer ended
        latency = self.latency_s if self.latency_s is not None else 0.0
        latency_ms = round(latency * 1000)
        return Outcome(model, route, status, latency_ms, tuple(parts))

    def _close(self, upstream: UpstreamResponse) -> None:
        if not upstream.is_closed:
            upstream.close()


class FlightStream:
    """The body iterator of a streaming response: the events, and `finish` when the
    stream ends, fails, is cancelled (client gone), or is dropped unstarted (a client
    that left before the response began)."""

    def __init__(self, flight: Flight, events: AsyncIterator[bytes]) -> None:
        self.flight = flight
        self.events = events

    def __aiter__(self) -> "FlightStream":
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.events.__anext__()
        except BaseException:
            self.flight.finish()
            raise

    def __del__(self) -> None:
        if not self.flight.finished:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                log.warning("stream of %s dropped outside the loop", self.flight.plan.request_id)
                return
            self.flight.finish()
