"""A pool's waiting requests, weighted fair across tenants: `FairQueue` is the pure data
structure (deficit round robin by tokens, FIFO within a tenant, bounded by requests and
tokens, clock injected); `QueueConfig` its bounds; `Ticket` one waiting request.
`gateway.capacity.admission.AdmissionController` is the asyncio layer over it."""

import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from gateway.capacity.refusals import QueueFull


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
