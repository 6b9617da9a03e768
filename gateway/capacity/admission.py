"""The gateway's per-pool admission: `AdmissionController`, the asyncio layer over the
pool's `FairQueue` (`gateway.capacity.fair_queue`). A request waits both for its fair turn
and for the pool to have room, and leaves the queue when its deadline passes, its latest
start passes (refused `OverCapacity`), or its client goes away.
"""

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass

from gateway.capacity.fair_queue import FairQueue, Ticket
from gateway.capacity.refusals import DeadlineExceeded, NoReplica, OverCapacity


@dataclass(slots=True)
class _Waiter:
    ticket: Ticket
    future: asyncio.Future[None]
    timer: asyncio.TimerHandle | None
    expires_at: float  # the ticket's deadline, or sooner by the queue's max_wait_s


class AdmissionController:
    """asyncio layer over FairQueue for one pool: requests wait for their turn AND for
    the pool to have room. While the pool has no live replica (`live()` false: every
    member unreachable, stalled or draining, or none), nothing waits for one: a request is
    refused at once (NoReplica, 503) and those already waiting are refused at the next
    `kick` (each load poll), instead of waiting out their deadlines.

    Dispatch is driven by `acquire`, `release`, `kick` and deadline timers; there is no
    background task. One ticket is dispatched at a time: the next goes only after the
    previous one's task has resumed, so `has_room()` sees the capacity it took. The
    caller must therefore take its capacity (count the request in flight on its worker)
    before its first await after `acquire` returns, and give it back before `release`.
    """

    def __init__(
        self,
        queue: FairQueue,
        has_room: Callable[[], bool],
        clock: Callable[[], float],
        slots: Callable[[], tuple[int, int]] | None = None,
        live: Callable[[], bool] | None = None,
        name: str = "the pool",
    ) -> None:
        self._queue = queue
        self._has_room = has_room
        self._clock = clock
        self._slots = slots  # (free, total) worker slots; None: no reserve for light tenants
        self._live = live  # whether any replica serves or soon will; None: always
        self.name = name
        self._waiters: dict[str, _Waiter] = {}
        self._num_unclaimed = 0  # dispatched tickets whose task has not resumed yet
        self._num_dispatched = 0  # dispatched and not yet released
        # Per tenant, dispatched and not yet released: requests, and their cost tokens.
        self._by_tenant: dict[str, int] = {}
        self._tokens_of: dict[str, int] = {}
        self._num_tokens_dispatched = 0
        self._last_seen: dict[str, float] = {}  # tenant -> its last arrival (queue clock)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_dispatched(self) -> int:
        """Requests dispatched by `acquire` and not yet `release`d."""
        return self._num_dispatched

    async def acquire(self, ticket: Ticket) -> None:
        """Return when `ticket` is dispatched; the caller then sends it to a worker.

        Raises QueueFull at once when the queue is full, and DeadlineExceeded when the
        deadline passes first (the ticket leaves the queue). If the awaiting task is
        cancelled (client disconnect), the ticket leaves the queue.
        """
        future = self.enqueue(ticket)
        if future is not None:
            await self.wait(ticket, future)

    def enqueue(self, ticket: Ticket) -> "asyncio.Future[None] | None":
        """The synchronous half of `acquire`: None when the ticket is dispatched at once
        (nothing waits and there is room); else a future to pass to `wait`, or to `abandon`
        if the caller gives up before waiting. Raises QueueFull or DeadlineExceeded."""
        now = self._clock()
        if ticket.deadline <= now:
            raise DeadlineExceeded(ticket.request_id, ticket.deadline, 0.0, "start")
        if self._live is not None and not self._live():
            raise self._no_live_replica()
        self._last_seen[ticket.tenant_id] = now
        if (
            len(self._queue) == 0
            and self._num_unclaimed == 0
            and self._has_room()
            and self._may_take(ticket.tenant_id)
        ):
            self._taken(ticket)
            return None
        for pushed_out in self._queue.push(ticket):
            self._fail(pushed_out, self._queue.full_error("requests"))
        loop = asyncio.get_running_loop()
        timer = None
        expires_at = ticket.deadline
        max_wait_s = self._queue.config.max_wait_s
        if max_wait_s is not None:
            expires_at = min(expires_at, now + max_wait_s)
        expires_at = min(expires_at, ticket.start_by)
        if math.isfinite(expires_at):
            timer = loop.call_later(expires_at - now, self._expire, ticket.request_id)
        future: asyncio.Future[None] = loop.create_future()
        self._waiters[ticket.request_id] = _Waiter(ticket, future, timer, expires_at)
        self._dispatch()
        return future

    async def wait(self, ticket: Ticket, future: "asyncio.Future[None]") -> None:
        """Wait for a ticket `enqueue` queued; cancelling the wait leaves the queue."""
        try:
            await future
        except asyncio.CancelledError:
            self.abandon(ticket, future)
            raise
        self._num_unclaimed -= 1
        self._taken(ticket)
        # Runs after this task's current step, i.e. after the caller took its capacity.
        asyncio.get_running_loop().call_soon(self._dispatch)

    def release(self, ticket: Ticket) -> None:
        """A dispatched request finished (its capacity is back): dispatch what fits."""
        self._num_dispatched = max(0, self._num_dispatched - 1)
        tenant_id = ticket.tenant_id
        held = self._by_tenant.get(tenant_id, 0) - 1
        tokens = self._tokens_of.get(tenant_id, 0) - ticket.cost_tokens
        if held > 0:
            self._by_tenant[tenant_id] = held
            self._tokens_of[tenant_id] = max(0, tokens)
        else:
            self._by_tenant.pop(tenant_id, None)
            self._tokens_of.pop(tenant_id, None)
        self._num_tokens_dispatched = max(0, self._num_tokens_dispatched - ticket.cost_tokens)
        self._dispatch()

    def dispatched_of(self, tenant_id: str) -> int:
        """The tenant's requests dispatched and not yet released."""
        return self._by_tenant.get(tenant_id, 0)

    def dispatched_tokens_of(self, tenant_id: str) -> int:
        """The cost tokens (prompt + max_tokens) of the tenant's requests dispatched and not
        yet released: the work it has on the workers."""
        return self._tokens_of.get(tenant_id, 0)

    def _taken(self, ticket: Ticket) -> None:
        tenant_id = ticket.tenant_id
        self._num_dispatched += 1
        self._by_tenant[tenant_id] = self._by_tenant.get(tenant_id, 0) + 1
        self._tokens_of[tenant_id] = self._tokens_of.get(tenant_id, 0) + ticket.cost_tokens
        self._num_tokens_dispatched += ticket.cost_tokens

    def _may_take(self, tenant_id: str) -> bool:
        """Whether a request of `tenant_id` may take a slot now: always while more than the
        reserve is free or it is the only active tenant, else only under its fair share."""
        return self._shares()[1](tenant_id)

    def _shares(self) -> tuple[Callable[[str], bool], Callable[[str], bool]]:
        """(under its fair share, may take a slot now) for any tenant, from one snapshot of
        the slots and the active tenants, so that a dispatch visiting every tenant in the
        queue costs one pass over them, not one per visit. The active tenants are counted
        only when a share is asked for: with more than the reserve free (the usual case
        on a request's path) nobody needs them.

        A tenant's share is of two things, and it is under it only when under in both: the
        slots (it holds fewer than total / active tenants) and the work on the workers, in
        cost tokens (prompt + max_tokens; it holds at most the active tenants' average). So
        a tenant with a few long prompts in flight does not count as light beside one with
        many short requests, and a tenant of many tiny requests cannot take every slot."""
        if self._slots is None:
            return (lambda _: False), (lambda _: True)
        free, total = self._slots()
        reserve = math.ceil(total * self._queue.config.reserve_fraction)
        held, tokens_of = self._by_tenant, self._tokens_of
        tokens_held = self._num_tokens_dispatched
        active: set[str] | None = None

        def under(tenant_id: str) -> bool:
            nonlocal active
            if active is None:
                active = self._active_tenants()
            num_active = len(active) + (tenant_id not in active)
            if num_active <= 1:
                return True
            return (
                held.get(tenant_id, 0) * num_active < total
                and tokens_of.get(tenant_id, 0) * num_active <= tokens_held
            )

        def may_take(tenant_id: str) -> bool:
            return free > reserve or under(tenant_id)

        return under, may_take

    def _active_tenants(self) -> set[str]:
        """Tenants with requests in flight or queued, or arrived within active_window_s
        (older arrivals are forgotten here)."""
        active = set(self._by_tenant)
        active.update(self._queue.tenants())
        horizon = self._clock() - self._queue.config.active_window_s
        for other, seen in list(self._last_seen.items()):
            if seen >= horizon:
                active.add(other)
            elif other not in active:
                del self._last_seen[other]
        return active

    def kick(self) -> None:
        """Capacity may have changed (worker loads refreshed): dispatch what fits, or, with
        no live replica left, refuse everything waiting."""
        if self._waiters and self._live is not None and not self._live():
            for waiter in list(self._waiters.values()):
                self._queue.remove(waiter.ticket.request_id)
                self._fail(waiter.ticket, self._no_live_replica())
            return
        self._dispatch()

    def _no_live_replica(self) -> NoReplica:
        return NoReplica(self.name, self._queue.config.retry_after_s, "is live to take")

    def _dispatch(self) -> None:
        while self._num_unclaimed == 0 and len(self._queue) > 0 and self._has_room():
            # Tenants under their fair share first (a light tenant does not wait out a
            # flood's turns), then fair order among those allowed a slot now.
            ticket: Ticket | None = None
            dropped: list[Ticket] = []
            under, may_take = self._shares()
            if self._slots is not None and len(self._queue.tenants()) > 1:
                ticket, dropped = self._queue.pop(under)
            if ticket is None:
                ticket, more = self._queue.pop(may_take)
                dropped += more
            for expired in dropped:
                self._fail(expired)
            if ticket is None:
                return
            waiter = self._waiters.pop(ticket.request_id, None)
            if waiter is None or waiter.future.done():
                continue  # cancelled, its task has not run its handler yet
            if waiter.timer is not None:
                waiter.timer.cancel()
            waiter.future.set_result(None)
            self._num_unclaimed += 1

    def _expire(self, request_id: str) -> None:
        waiter = self._waiters.get(request_id)
        if waiter is None:
            return
        remaining_s = waiter.expires_at - self._clock()
        if remaining_s > 0:  # the loop's timer ran a little ahead of our clock
            loop = asyncio.get_running_loop()
            waiter.timer = loop.call_later(remaining_s, self._expire, request_id)
            return
        self._queue.remove(request_id)
        ticket = waiter.ticket
        error = None
        if ticket.start_by <= waiter.expires_at < ticket.deadline:
            wait = self._queue.config.retry_after_s + self._queue.jitter()
            error = OverCapacity(self.name, None, ticket.ttft_target_s, wait)
        self._fail(ticket, error)

    def _fail(self, ticket: Ticket, error: Exception | None = None) -> None:
        """End a waiting ticket's wait with `error` (default: its deadline passed)."""
        waiter = self._waiters.pop(ticket.request_id, None)
        if waiter is None:
            return
        if waiter.timer is not None:
            waiter.timer.cancel()
        if not waiter.future.done():
            if error is None:
                waited_s = self._clock() - ticket.enqueued_at
                error = DeadlineExceeded(ticket.request_id, ticket.deadline, waited_s)
            waiter.future.set_exception(error)

    def abandon(self, ticket: Ticket, future: "asyncio.Future[None]") -> None:
        """The ticket's caller gave up before (or while) waiting: leave the queue, or pass
        on a turn that was given and will not be used. Call it at most once per ticket."""
        waiter = self._waiters.pop(ticket.request_id, None)
        if waiter is not None:  # still waiting: leave the queue
            if waiter.timer is not None:
                waiter.timer.cancel()
            self._queue.remove(ticket.request_id)
        elif future.done() and not future.cancelled():
            if future.exception() is None:
                # Dispatched, but the caller will never use it: pass the turn on.
                self._num_unclaimed -= 1
                self._dispatch()
