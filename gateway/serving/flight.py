"""The owner of one request in the gateway, from its reservation to its reconcile.

A `Flight` holds the request's quota reservations and one `Attempt` per pool it is sent to
(an escalated request makes two). Each attempt has its own `Lease` (queue turn and worker
slot) and records what it was served.

The handler serves the request inside `with flight:`, and leaving that block, however it is
left (an answer, a refusal, an error, a cancelled task, a client gone mid-stream), is the one
place the request settles: work still opening cancelled, upstream connections closed (which
tells a worker to abort unfinished work), leases released (a completion recorded only for
attempts a worker answered), and the reservations reconciled to the sum of what every
attempt is charged, the request's `Outcome` handed to the gateway with it. Settling never
awaits, so it is safe from a cancelled task.
"""

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.billing.prices import PoolPrice, Tokens, cost_nanos
from gateway.billing.savings import auto_cost
from gateway.capacity.fair_queue import Ticket
from gateway.capacity.goodput import meets_targets
from gateway.capacity.lease import Lease
from gateway.serving.plan import Plan, PublicRequest, Served, billed
from gateway.serving.record import Outcome, RequestRecord
from quota.limiter import Reservation
from quota.usage import UsagePart
from workers.api.client import UpstreamResponse
from workers.api.types import Usage

if TYPE_CHECKING:
    from gateway.gateway import Gateway


@dataclass(slots=True)
class Attempt:
    lease: Lease
    served: Served = field(default_factory=Served)
    upstream: UpstreamResponse | None = None
    opening: "asyncio.Future[UpstreamResponse] | None" = None  # its dispatch, while pending
    reading: "asyncio.Future[bytes] | None" = None  # the relay's pending read (abort cancels it)
    first_token_s: float | None = None  # a stream: arrival to its first token relayed
    max_itl_s: float = 0.0  # a stream: its longest gap between tokens relayed
    sent_at: float = 0.0  # time.monotonic() when its turn came and it was sent


class Flight:
    """One request's reservations and attempts; settled when its `with` block ends."""

    __slots__ = (
        "gw",
        "plan",
        "req",
        "reservation",
        "key_reservation",
        "record",
        "headers",
        "client_deadline",
        "attempts",
        "settled",
        "started_at",
        "abort_error",
        "aborted",
        "prices",
    )

    def __init__(
        self,
        gw: "Gateway",
        plan: Plan,
        req: PublicRequest,
        reservation: Reservation,
        record: RequestRecord,
        headers: dict[str, str],
        *,
        key_reservation: Reservation | None = None,
        client_deadline: bool = False,
        prices: Mapping[str, PoolPrice] | None = None,
    ) -> None:
        self.gw = gw
        self.plan = plan
        self.req = req
        self.reservation = reservation
        self.key_reservation = key_reservation  # under the key's own limits, if it has any
        self.record = record  # its status is the one the outcome reports
        self.headers = headers  # the response's (escalation names the pool that answered)
        self.client_deadline = client_deadline  # the deadline is the client's x-request-timeout
        self.attempts: list[Attempt] = []
        self.settled = False
        self.started_at = time.monotonic()
        self.abort_error: Exception | None = None  # why the gateway cut this request short
        # Done when the gateway cuts the request short: a plain future, so the serving
        # code waits on it beside its work without a task of its own.
        self.aborted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # The price list it was admitted under, reserve to settlement ({}: unpriced).
        self.prices: Mapping[str, PoolPrice] = prices if prices is not None else {}

    def __enter__(self) -> "Flight":
        self.gw.flights.add(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._settle()

    def attempt(self, pool_name: str) -> Attempt:
        """A new attempt on `pool_name`, queued at once: raises QueueFull or
        DeadlineExceeded before any response has started."""
        plan = self.plan
        suffix = f"-{len(self.attempts)}" if self.attempts else ""
        pool = self.gw.pools[pool_name]
        now = time.monotonic()
        # The first attempt's TTFT target counts from the request's arrival (its intake
        # took time already); an escalation's from its own start.
        since_arrival = time.perf_counter() - self.record.arrived_at
        ticket = Ticket(
            plan.request_id + suffix,
            plan.tenant_id,
            plan.attempt_tokens,
            now,
            plan.deadline,
            prompt_tokens=plan.prompt_tokens,
            max_tokens=plan.n * plan.max_tokens,
            ttft_target_s=pool.ttft_target_for(plan.priority),
            arrived_at=None if self.attempts else now - max(0.0, since_arrival),
        )
        attempt = Attempt(Lease(pool, ticket, plan.affinity))
        self.attempts.append(attempt)
        attempt.lease.enqueue()
        return attempt

    def track(self, attempt: Attempt, upstream: UpstreamResponse) -> None:
        """The worker answered `attempt`: keep its response to close it at the end."""
        attempt.upstream = upstream
        attempt.served.accepted = upstream.status_code == 200
        if self.settled:  # the request ended while the answer was on its way
            _close(upstream)

    def abort(self, error: Exception) -> None:
        """Cut the request short (the gateway is shutting down): whoever serves it answers
        the client with `error`, in-band for a committed stream, then its block ends."""
        if self.settled or self.abort_error is not None:
            return
        self.abort_error = error
        self.aborted.set_result(None)
        for a in self.attempts:
            if a.reading is not None and not a.reading.done():
                a.reading.cancel()

    def _cost_of(self, a: Attempt, bill: Usage, now: float, observe: bool = False) -> int:
        """What one attempt costs at the flight's prices: its billed tokens, or the engine
        seconds its worker reported, bounded by the attempt's own wall time."""
        pool = a.lease.pool.name
        price = self.prices.get(pool)
        if price is None:
            return 0
        seconds = a.served.usage_compute_s
        if seconds is not None:
            seconds = min(seconds, max(0.0, now - a.sent_at)) if a.sent_at else None
        details = bill.prompt_tokens_details
        cached = details.cached_tokens if details is not None else 0
        used = Tokens(bill.prompt_tokens, cached, bill.completion_tokens, seconds)
        if observe and seconds is not None and price.by_compute:
            self.gw.prices.observe_compute(pool, bill.total_tokens, seconds)
        return cost_nanos(price, used, self.gw.prices.compute_per_token_s(pool))

    def cost_so_far(self) -> int:
        """Nanos charged for what every attempt has been served until now (what the client
        is told with its usage)."""
        now = time.monotonic()
        total = 0
        for a in self.attempts:
            if a.served.usage_completion_tokens is None and not a.served.accepted:
                continue
            total += self._cost_of(a, billed(self.plan, a.served), now)
        return total

    def _settle(self) -> None:
        """Cancel, close, release, reconcile: once, when the flight's block ends."""
        self.settled = True
        self.gw.flights.discard(self)
        record, plan = self.record, self.plan
        charged = 0
        parts: list[UsagePart] = []
        model, route = plan.pool, plan.route
        cut = False  # a worker's answer that never reached its end
        answering: Attempt | None = None  # the attempt whose answer the client got
        answer_tokens = 0
        now = time.monotonic()
        cost = 0
        answer_bill: Usage | None = None
        for i, a in enumerate(self.attempts):
            if a.opening is not None:
                a.opening.cancel()  # no-op once done
            if a.upstream is not None:
                _close(a.upstream)
            served = a.served
            a.lease.release(served=served.accepted)
            if served.usage_completion_tokens is None:
                if not served.accepted:
                    continue  # refused or never dispatched: charged nothing
                cut = True
            model = a.lease.pool.name
            if i > 0:
                route = "escalated"
            bill = billed(plan, served)  # the worker's usage, clamped
            # The pool's tokens per second, and how much of max_tokens answers use.
            a.lease.pool.record_tokens(bill.completion_tokens, a.lease.ticket.max_tokens)
            details = bill.prompt_tokens_details
            cached = details.cached_tokens if details is not None else 0
            part_cost = self._cost_of(a, bill, now, observe=True)
            parts.append(
                UsagePart(model, bill.prompt_tokens, cached, bill.completion_tokens, part_cost)
            )
            answering, answer_tokens, answer_bill = a, bill.completion_tokens, bill
            charged += bill.total_tokens
            cost += part_cost
        status = record.status if record.status is not None else 499
        if status == 200 and cut:
            status = 499  # the client left before the answer ended
        record.status, record.tokens = status, charged
        if status == 200 and answering is not None:
            _count_goodput(answering, plan, answer_tokens, time.perf_counter() - record.arrived_at)
        latency_ms = round((time.perf_counter() - record.arrived_at) * 1000)
        auto = None
        if plan.score is not None and answer_bill is not None and self.prices:
            auto = auto_cost(self.gw, self.prices, answer_bill, cost, route)
        outcome = Outcome(record.key_id, model, route, status, latency_ms, tuple(parts), auto)
        self.gw.reconcile_later(self.reservation, charged, outcome, cost)
        if self.key_reservation is not None:  # the key's own windows: the same charge
            self.gw.reconcile_later(self.key_reservation, charged, cost_nanos=cost)


def _count_goodput(attempt: Attempt, plan: Plan, num_tokens: int, whole_s: float) -> None:
    """A request served to its end by `attempt`: counted in its pool's goodput."""
    pool, ticket = attempt.lease.pool, attempt.lease.ticket
    met = meets_targets(
        ticket.ttft_target_s,
        pool.itl_target_s,
        first_token_s=attempt.first_token_s,
        max_itl_s=attempt.max_itl_s,
        whole_s=whole_s,
        num_tokens=-(-num_tokens // max(1, plan.n)),  # per sample: they decode side by side
    )
    pool.goodput.record(met, ticket.prompt_tokens, ticket.max_tokens)


def _close(upstream: UpstreamResponse) -> None:
    if not upstream.is_closed:
        upstream.close()
