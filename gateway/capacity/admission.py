"""The gateway's per-pool admission queue: weighted fair queuing across tenants.

`FairQueue` is the pure data structure (deficit round robin by tokens, FIFO within a
tenant, bounded by requests and tokens, clock injected). `AdmissionController` is the
asyncio layer over it: a request waits both for its fair turn and for the pool to have
room, and leaves the queue when its deadline passes or its client goes away.
"""

import asyncio
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass


class QueueFull(Exception):
    """The pool's queue is over a bound; the client should retry after `retry_after_s`.

    `reason` is "requests" or "tokens" (which bound); `retry_after_s` is jittered so
    refused clients do not come back as one wave.
    """

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(f"admission queue full ({reason}); retry after {retry_after_s:.2f} s")
        self.reason = reason
        self.retry_after_s = retry_after_s


class NoReplica(Exception):
    """No replica of the pool has room for this request now (all busy, draining, down or
    already tried), or the pool has no live replica at all (`gateway.capacity.balancer.is_live`):
    the client may retry after `retry_after_s`."""

    def __init__(self, pool: str, retry_after_s: float = 1.0, why: str = "could take") -> None:
        super().__init__(f"no replica of {pool} {why} the request")
        self.pool = pool
        self.retry_after_s = retry_after_s


class OverCapacity(Exception):
    """The pool cannot give this request its first token within its TTFT target now:
    refused at arrival (`predicted_s`: the predicted TTFT; the capacity model,
    `gateway.capacity.predictor`), or while it waited (its latest start passed:
    `predicted_s` is None). The client may retry after `retry_after_s`."""

    def __init__(
        self, pool: str, predicted_s: float | None, target_s: float, retry_after_s: float
    ) -> None:
        if predicted_s is None:
            why = "it could not start in time to meet"
        elif math.isfinite(predicted_s):
            why = f"its first token is predicted after {predicted_s:.2f} s, past"
        else:
            why = "no replica can take it within"
        super().__init__(f"{pool} is over capacity: {why} the TTFT target of {target_s:.2f} s")
        self.pool = pool
        self.predicted_s = predicted_s
        self.target_s = target_s
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    """The request's deadline passed. `stage` says where: "queue" (it waited behind others
    and was never dispatched: overload), "start" (it was already past when it arrived), or
    "dispatch" (a worker had it and did not answer in time)."""

    def __init__(
        self, request_id: str, deadline: float, waited_s: float, stage: str = "queue"
    ) -> None:
        super().__init__(f"request {request_id} missed its deadline ({stage}, {waited_s:.3f} s)")
        self.request_id = request_id
        self.deadline = deadline
        self.waited_s = waited_s
        self.stage = stage


@dataclass
class QueueConfig:
    max_requests: int = 256  # waiting requests per pool
    max_tokens: int = 262144  # waiting cost tokens per pool (prompt + max_tokens)
    # Deficit-round-robin credit per tenant visit, times weight. Small against a request's
    # cost (prompt + max_tokens), so tenants alternate request by request: with a large
    # quantum a flooding tenant sends a long run of requests on each of its turns.
    quantum_tokens: int = 256
    # Share of the pool's slots kept for tenants under their fair share (slots / active
    # tenants) while several tenants are active: a tenant over its share takes a slot only
    # while more than this many are free, so a light tenant's request finds one at once
    # instead of waiting for a flooding tenant's to end. Unused with one active tenant.
    reserve_fraction: float = 0.125
    # A tenant counts as active (for the reserve) while it has requests queued or in
    # flight, and for this long after its last arrival: a light tenant between two of its
    # requests keeps its reserve instead of finding every slot taken by a flood.
    active_window_s: float = 2.0
    # Longest a request may wait for its turn; past it, it leaves the queue refused (503,
    # Retry-After) so that what is accepted starts promptly under overload. None: only the
    # request's own deadline bounds its wait.
    max_wait_s: float | None = None
    retry_after_s: float = 1.0  # Retry-After base of a refusal
    retry_after_jitter_s: float = 1.0  # plus uniform(0, this)


@dataclass(slots=True)
class Ticket:
    """One waiting request. Times are in the queue clock's seconds."""

    request_id: str
    tenant_id: str
    cost_tokens: int  # prompt tokens + max_tokens
    enqueued_at: float
    deadline: float  # math.inf for none
    weight: float = 1.0  # the tenant's share relative to others; the latest push wins
    # Its size, for the capacity model (cost_tokens = prompt_tokens + n * max_tokens).
    prompt_tokens: int = 0
    max_tokens: int = 0
    # The latest dispatch that still meets its TTFT target (`Pool.admit`); past it, it
    # leaves the queue refused (OverCapacity) before any token. inf: no bound.
    start_by: float = math.inf
    ttft_target_s: float = math.inf  # the target behind start_by (for the refusal)
    # When the request reached the gateway (the queue clock); its TTFT target counts from
    # there, so time spent before the queue (a burst's intake) is charged. None: enqueued_at.
    arrived_at: float | None = None
    predicted_ttft_s: float | None = None  # from arrival, when `Pool.admit` predicted one


@dataclass(slots=True)
class _Tenant:
    tickets: deque[Ticket]
    weight: float
    deficit: float = 0.0  # tokens this tenant may still send before its turn passes
    tokens: int = 0  # cost tokens of its waiting tickets


class FairQueue:
    """Weighted fair queuing across tenants by tokens (deficit round robin), FIFO within
    a tenant, bounded by requests and tokens. Sync, no asyncio; the clock is injected.

    Each visit of a tenant adds `quantum_tokens * weight` to its deficit; it sends
    tickets while its head fits the deficit, then the turn passes. A flooding tenant
    therefore gets its share and no more, and any ticket waits at most a bounded number
    of rounds (the queue is bounded). A tenant whose queue empties loses its deficit.
    """

    def __init__(
        self,
        config: QueueConfig,
        clock: Callable[[], float],
        rng: random.Random | None = None,
    ) -> None:
        if config.quantum_tokens < 1:
            raise ValueError(f"quantum_tokens must be >= 1, got {config.quantum_tokens}")
        self.config = config
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._tenants: dict[str, _Tenant] = {}  # tenants with waiting tickets only
        self._ring: deque[str] = deque()  # active tenants; _ring[0] is being visited
        self._granted = False  # _ring[0] already got its quantum on this visit
        self._by_id: dict[str, Ticket] = {}
        self._num_tokens = 0

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def waiting_tokens(self) -> int:
        return self._num_tokens

    def estimated_wait_s(self, drain_tokens_per_s: float) -> float:
        """Seconds to drain what waits at `drain_tokens_per_s`; 0 when nothing waits,
        inf when something waits and the rate is 0."""
        if self._num_tokens == 0:
            return 0.0
        if drain_tokens_per_s <= 0:
            return math.inf
        return self._num_tokens / drain_tokens_per_s

    def ahead_of(self, tenant_id: str) -> list[Ticket]:
        """The waiting tickets a new ticket of `tenant_id` would go after, in about the
        order they go: all of its tenant's, and of every other tenant as many as its own
        plus one (fair order takes turns). Deadline order is ignored."""
        own = self._tenants.get(tenant_id)
        num_own = len(own.tickets) if own is not None else 0
        ahead: list[Ticket] = []
        for other, tenant in self._tenants.items():
            if other == tenant_id:
                ahead.extend(tenant.tickets)
            else:
                ahead.extend(itertools.islice(tenant.tickets, num_own + 1))
        return ahead

    def jitter(self) -> float:
        """A refusal's Retry-After jitter: uniform over [0, retry_after_jitter_s]."""
        return self._rng.uniform(0.0, self.config.retry_after_jitter_s)

    def push(self, ticket: Ticket) -> list[Ticket]:
        """Queue `ticket` at the tail of its tenant's line; the tickets pushed out to make
        room for it (refuse them: QueueFull).

        A full queue is shared fairly: to make room it pushes out the newest tickets of the
        tenant that holds the most of it, if that is another tenant holding more than the
        newcomer's would hold with it; else it raises QueueFull (the newcomer's tenant has
        its share, or more). So a flooding tenant cannot fill the queue against a light
        one. A ticket larger than
        `max_tokens` alone is admitted into an empty queue, so no request is refused
        forever. Raises ValueError on a duplicate request id or a bad cost or weight.
        """
        if ticket.request_id in self._by_id:
            raise ValueError(f"request {ticket.request_id} is already queued")
        if ticket.cost_tokens < 0 or not ticket.weight > 0:
            raise ValueError(
                f"need cost_tokens >= 0 and weight > 0, got {ticket.cost_tokens}, {ticket.weight}"
            )
        evicted = self._make_room(ticket)
        tenant = self._tenants.get(ticket.tenant_id)
        if tenant is None:
            tenant = self._tenants[ticket.tenant_id] = _Tenant(deque(), ticket.weight)
            self._ring.append(ticket.tenant_id)
        tenant.weight = ticket.weight
        tenant.tickets.append(ticket)
        tenant.tokens += ticket.cost_tokens
        self._by_id[ticket.request_id] = ticket
        self._num_tokens += ticket.cost_tokens
        return evicted

    def _over(self, ticket: Ticket) -> str | None:
        """Which bound `ticket` would pass now, if any."""
        if len(self._by_id) >= self.config.max_requests:
            return "requests"
        if self._by_id and self._num_tokens + ticket.cost_tokens > self.config.max_tokens:
            return "tokens"
        return None

    def _make_room(self, ticket: Ticket) -> list[Ticket]:
        reason = self._over(ticket)
        if reason is None:
            return []
        # Plan first (nothing changes unless room can be made), newest tickets of whoever
        # holds the most queued tokens, while that is more than the newcomer's would hold.
        own = self._tenants.get(ticket.tenant_id)
        own_tokens = ticket.cost_tokens + (own.tokens if own is not None else 0)
        held = {t: v.tokens for t, v in self._tenants.items() if t != ticket.tenant_id}
        taken = {t: 0 for t in held}
        num, tokens = len(self._by_id), self._num_tokens
        plan: list[Ticket] = []
        while num >= self.config.max_requests or (
            num and tokens + ticket.cost_tokens > self.config.max_tokens
        ):
            victim = max(held, key=held.__getitem__, default=None)
            if victim is None or held[victim] <= own_tokens:
                raise self._full(reason)
            lane = self._tenants[victim].tickets
            taken[victim] += 1
            newest = lane[-taken[victim]]
            plan.append(newest)
            held[victim] -= newest.cost_tokens
            num, tokens = num - 1, tokens - newest.cost_tokens
        for pushed_out in plan:
            lane = self._tenants[pushed_out.tenant_id].tickets
            lane.pop()
            self._forget(pushed_out)
            if not lane:
                self._retire(pushed_out.tenant_id)
        return plan

    def tenants(self) -> Collection[str]:
        """Tenants with tickets waiting."""
        return self._tenants.keys()

    def pop(
        self, eligible: Callable[[str], bool] | None = None
    ) -> tuple[Ticket | None, list[Ticket]]:
        """The next ticket in fair order (None when nothing live waits, or no tenant with
        tickets is `eligible` now), and the tickets dropped on the way because their
        deadline passed (never to be dispatched). A tenant that is not eligible keeps its
        place and deficit; its turn passes."""
        now = self._clock()
        dropped: list[Ticket] = []
        num_passed = 0  # turns passed in a row without sending anything
        skipped: set[str] = set()  # tenants passed over as not eligible
        while self._ring:
            tenant_id = self._ring[0]
            tenant = self._tenants[tenant_id]
            tickets = tenant.tickets
            while tickets and tickets[0].deadline <= now:
                dropped.append(self._forget(tickets.popleft()))
            if not tickets:
                self._retire(tenant_id)
                skipped.discard(tenant_id)
                continue
            if eligible is not None and not eligible(tenant_id):
                skipped.add(tenant_id)
                if len(skipped) >= len(self._ring):
                    return None, dropped  # nobody waiting may take a slot now
                self._ring.rotate(-1)
                self._granted = False
                continue
            if not self._granted:
                tenant.deficit += self.config.quantum_tokens * tenant.weight
                self._granted = True
            head = tickets[0]
            if head.cost_tokens <= tenant.deficit:
                tickets.popleft()
                tenant.deficit -= head.cost_tokens
                if not tickets:
                    self._retire(tenant_id)
                return self._forget(head), dropped
            self._ring.rotate(-1)
            self._granted = False
            num_passed += 1
            if num_passed >= len(self._ring) - len(skipped):
                self._fast_forward(now, skipped)
                num_passed = 0
        return None, dropped

    def remove(self, request_id: str) -> bool:
        """Take a waiting ticket out (its client gave up); False if it is not queued."""
        ticket = self._by_id.get(request_id)
        if ticket is None:
            return False
        tenant = self._tenants[ticket.tenant_id]
        tenant.tickets.remove(ticket)
        self._forget(ticket)
        if not tenant.tickets:
            self._retire(ticket.tenant_id)
        return True

    def full_error(self, reason: str) -> QueueFull:
        """A refusal for a full queue, with a jittered Retry-After."""
        return self._full(reason)

    def _full(self, reason: str) -> QueueFull:
        jitter_s = self._rng.uniform(0.0, self.config.retry_after_jitter_s)
        return QueueFull(reason, self.config.retry_after_s + jitter_s)

    def _forget(self, ticket: Ticket) -> Ticket:
        del self._by_id[ticket.request_id]
        self._num_tokens -= ticket.cost_tokens
        tenant = self._tenants.get(ticket.tenant_id)
        if tenant is not None:
            tenant.tokens -= ticket.cost_tokens
        return ticket

    def _retire(self, tenant_id: str) -> None:
        del self._tenants[tenant_id]
        if self._ring[0] == tenant_id:
            self._ring.popleft()
            self._granted = False
        else:
            self._ring.remove(tenant_id)

    def _fast_forward(self, now: float, skipped: set[str]) -> None:
        # A whole round sent nothing: every head is larger than its tenant's deficit.
        # Hand out at once the rounds in which nobody could send, instead of looping
        # through them (a large ticket against a small quantum would take many rounds).
        need = math.inf
        for tenant_id, tenant in self._tenants.items():
            if tenant_id in skipped:
                continue
            head = tenant.tickets[0]
            if head.deadline <= now:
                return  # it will be dropped on its visit, changing that tenant's head
            credit = self.config.quantum_tokens * tenant.weight
            need = min(need, math.ceil((head.cost_tokens - tenant.deficit) / credit))
        num_rounds = int(need) - 1
        if num_rounds > 0 and math.isfinite(need):
            for tenant_id, tenant in self._tenants.items():
                if tenant_id in skipped:
                    continue
                tenant.deficit += num_rounds * self.config.quantum_tokens * tenant.weight


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
