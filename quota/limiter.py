"""Token, request and concurrency quotas: reserve before dispatch, reconcile after.

The decisions run inside two Lua scripts (`quota/lua/`) on the Redis server clock; this module
builds their keys, reads their replies through `quota.policy`, and applies the failure policy
when Redis is unreachable.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio
from prometheus_client import CollectorRegistry, Counter
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from quota import keyspace
from quota.budget import Budget, spend_windows
from quota.errors import QuotaUnavailable
from quota.journal import ReconcileJournal, Settlement
from quota.models import Tenant
from quota.pipelined import PipelinedRedis
from quota.policy import (
    STATUS_ADMITTED,
    STATUS_STALE_WINDOWS,
    UNAVAILABLE_RETRY_AFTER_S,
    FailurePolicy,
    RateLimitState,
    ReserveReply,
    Windows,
    exceeded_error,
    rate_limit_state,
    unavailable_decisions,
    unlimited_state,
    windows_at,
)
from quota.scripts import QuotaScripts
from quota.usage import UsageConfig

__all__ = ["FailurePolicy", "QuotaLimiter", "RateLimitState", "Reservation"]

log = logging.getLogger(__name__)

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)
_RESERVE_ATTEMPTS = 3  # a stale-window retry twice in a row needs two window rolls


@dataclass
class Reservation:
    """Tokens held for one request until `reconcile`. Window indices are on the Redis clock."""

    tenant_id: str
    request_id: str
    tokens: int  # reserved: prompt + max_tokens
    minute: int | None = None  # minute window charged (floor(unix_s/60)); None when unchecked
    day: int | None = None  # day window charged (floor(unix_s/86400)); None when unchecked
    holds_slot: bool = False  # took a concurrency slot
    checked: bool = True  # False: Redis was down and every limit class failed open
    reconciled: bool = False  # set by reconcile; a second reconcile does nothing
    owner_id: str | None = None  # the gateway whose pending index holds it; None: not indexed
    cost_nanos: int = 0  # money reserved: the request's worst case (quota.budget)
    spent_nanos: int = 0  # the budget period's spend after this reservation (0: no budget)
    soft_crossed: bool = False  # this reservation crossed its holder's soft budget, first


class QuotaLimiter:
    """Reserves and reconciles tokens against a tenant's limits in Redis.

    `redis`: a client from `quota.connection.make_redis` (bounded retries): while Redis is
    unreachable, `reserve` waits for the client's retries before the failure policy applies.
    `registry`: where the Prometheus counters go (None: a private registry, nothing exported).
    `concurrency_lease_s`: a slot not released by reconcile frees itself after this long, the
    last resort when no sweeper runs; a request running longer loses its slot. `clock` (unix
    seconds) only guesses the server's windows; the server's own clock decides.
    `owner_id`: this gateway's id (see `quota.sweeper`): reservations are indexed under it so
    a sweeper settles them if this gateway dies; None: not indexed (slots wait for the lease).
    `journal`: where settlements Redis could not take go, for the sweeper to apply; None: such
    a reconcile is lost (counted) and an unchecked request is charged only if Redis is back by
    its reconcile. `usage`: retention of the usage records reconcile writes (`quota.usage`).
    `pipelined`: where the reserve and reconcile scripts run (one shared connection, with
    the same retries and timeouts as `redis`: `quota.pipelined`); None: on `redis`. The
    limiter closes it (`aclose`).
    """

    def __init__(
        self,
        redis: redis.asyncio.Redis,
        policy: FailurePolicy | None = None,
        registry: CollectorRegistry | None = None,
        concurrency_lease_s: float = 600.0,
        *,
        clock: Callable[[], float] = time.time,
        owner_id: str | None = None,
        journal: ReconcileJournal | None = None,
        usage: UsageConfig | None = None,
        pipelined: PipelinedRedis | None = None,
    ) -> None:
        if concurrency_lease_s <= 0:
            raise ValueError("concurrency_lease_s must be positive")
        if owner_id is not None and (not owner_id or "|" in owner_id or "}" in owner_id):
            raise ValueError("owner_id must be non-empty, without '|' or '}'")
        self._redis = redis
        self._policy = policy or FailurePolicy()
        self._lease_ms = int(concurrency_lease_s * 1000)
        self._clock = clock
        self._offset_s = 0.0  # server clock - local clock, learnt from each reply
        self._redis_down = False
        self.owner_id = owner_id
        self.journal = journal
        self.scripts = QuotaScripts(redis, usage, pipelined)
        registry = registry if registry is not None else CollectorRegistry()
        self._redis_errors = Counter(
            "switchyard_gateway_quota_redis_errors",
            "Quota checks that met an unreachable Redis, by limit class and the decision taken "
            "(open: admitted unchecked, closed: refused)",
            ["limit_class", "decision"],
            registry=registry,
        )
        self._reconcile_errors = Counter(
            "switchyard_gateway_quota_reconcile_errors",
            "Reconciles that met an unreachable Redis (journaled if there is a journal, else "
            "lost: the reservation stays charged)",
            registry=registry,
        )
        self._journaled = Counter(
            "switchyard_gateway_quota_journaled",
            "Settlements written to the journal for the sweeper, by kind (checked: a reconcile "
            "Redis could not take; unchecked: a request admitted while Redis was unreachable; "
            "void: a request refused then, whose reservation may have been made unheard)",
            ["kind"],
            registry=registry,
        )

    async def reserve(
        self, tenant: Tenant, request_id: str, tokens: int, cost_nanos: int = 0
    ) -> tuple[Reservation, RateLimitState]:
        """Charge `tokens` (prompt + max_tokens) and one request to every window of the tenant,
        and take a concurrency slot if it has max_concurrent: all or nothing. Calling it again
        with the same request id (before its reconcile) charges nothing more. `cost_nanos`:
        the request's worst-case cost, charged to the tenant's spend and refused
        (BudgetExceeded) past its hard budget, `tenant.budget`.

        Raises QuotaExceeded (nothing charged) or, with Redis unreachable and a limited class
        failing closed, QuotaUnavailable. Failing open gives `checked=False` and a state of
        Nones (journaled, so it is charged even if this gateway dies). Every reservation must
        be reconciled, even at 0 tokens, to free its slot.
        """
        if tokens < 0 or cost_nanos < 0:
            raise ValueError("tokens and cost_nanos must be >= 0")
        try:
            reply = await self._run_reserve(tenant, request_id, tokens, cost_nanos)
        except REDIS_DOWN as exc:
            self._note_down(exc)
            return self._reserve_unchecked(tenant, request_id, tokens, cost_nanos)
        self._note_up()
        if reply.status != STATUS_ADMITTED:
            holder = "key" if tenant.tenant_id.startswith(keyspace.KEY_QUOTA_PREFIX) else "tenant"
            raise exceeded_error(tenant.limits, reply, tenant.budget, holder)
        assert reply.windows is not None
        reservation = Reservation(
            tenant_id=tenant.tenant_id,
            request_id=request_id,
            tokens=tokens,
            minute=reply.windows.minute,
            day=reply.windows.day,
            holds_slot=tenant.limits.max_concurrent is not None,
            owner_id=self.owner_id,
            cost_nanos=cost_nanos,
            spent_nanos=reply.spent_nanos,
            soft_crossed=reply.soft_crossed,
        )
        return reservation, rate_limit_state(tenant.limits, reply)

    async def reconcile(
        self,
        reservation: Reservation,
        actual_tokens: int,
        usage: str | None = None,
        actual_cost_nanos: int = 0,
    ) -> None:
        """Correct the windows the reservation was charged to by (actual - reserved), clamped at
        zero, and release its concurrency slot. Idempotent: only the first call acts, here and
        in Redis. Never raises for an unreachable Redis: the settlement goes to the journal
        (the sweeper applies it, once, when Redis is back) or, without one, is lost (counted;
        the reservation stays charged, its slot frees at lease end). An unchecked reservation
        charges `actual_tokens` to the current windows instead, once. `usage`: the request's
        usage record (`quota.usage.usage_record`), written with the settlement, so also once
        and also through the journal. `actual_cost_nanos`: the money the request cost,
        corrected on its spend counters as its tokens are (0: all of the reservation's cost
        is given back)."""
        if reservation.reconciled:
            return
        settlement = self._settlement(
            reservation,
            max(0, int(actual_tokens)),
            usage=usage,
            actual_cost=max(0, int(actual_cost_nanos)),
        )
        try:
            await self.scripts.settle(settlement)
        except REDIS_DOWN as exc:
            self._note_down(exc)
            self._reconcile_errors.inc()
            if self.journal is not None:
                self._journal(settlement)
                reservation.reconciled = True
            return
        self._note_up()
        if self.journal is not None and not settlement.checked:
            self.journal.done(settlement.request_id)  # its admission-time record
        reservation.reconciled = True

    async def aclose(self) -> None:
        """Close the pipelined connection, if any (`redis` is the caller's to close)."""
        if self.scripts.pipelined is not None:
            await self.scripts.pipelined.aclose()

    async def usage(self, tenant_id: str) -> dict[str, int]:
        """The tenant's current windows: tokens reserved (reconciled where done) this minute and
        today, requests this minute, and requests holding a concurrency slot now (only counted
        for tenants with max_concurrent). Raises QuotaUnavailable if Redis is unreachable."""
        try:
            sec, usec = await self._redis.time()
            now_s = sec + usec / 1e6
            w = windows_at(now_s)
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.get(keyspace.tokens_minute(tenant_id, w.minute))
                pipe.get(keyspace.tokens_day(tenant_id, w.day))
                pipe.get(keyspace.requests_minute(tenant_id, w.minute))
                pipe.zcount(keyspace.concurrency(tenant_id), f"({int(now_s * 1000)}", "+inf")
                tpm, tpd, rpm, conc = await pipe.execute()
        except REDIS_DOWN as exc:
            raise QuotaUnavailable(UNAVAILABLE_RETRY_AFTER_S) from exc
        return {
            "tokens_this_minute": int(tpm or 0),
            "tokens_today": int(tpd or 0),
            "requests_this_minute": int(rpm or 0),
            "concurrent_requests": int(conc),
        }

    async def spent(self, holder_id: str, budget: Budget) -> tuple[int, float]:
        """(nanos spent in `budget`'s current period, Redis server time in unix seconds), read
        from the holder's spend counters (a tenant id, or a key's `keyspace.key_quota_id`).
        Raises QuotaUnavailable if Redis is unreachable."""
        try:
            sec, usec = await self._redis.time()
            now_s = sec + usec / 1e6
            spend = spend_windows(windows_at(now_s).day, budget)
            if budget.period == "month":
                keys = [keyspace.spend_month(holder_id, spend.month)]
            else:
                days = (spend.day, *spend.earlier_days)
                keys = [keyspace.spend_day(holder_id, d) for d in days]
            values = await self._redis.mget(keys)
        except REDIS_DOWN as exc:
            raise QuotaUnavailable(UNAVAILABLE_RETRY_AFTER_S) from exc
        return sum(int(v or 0) for v in values), now_s

    async def _run_reserve(
        self, tenant: Tenant, request_id: str, tokens: int, cost_nanos: int
    ) -> ReserveReply:
        windows = self._guess_windows()
        for _ in range(_RESERVE_ATTEMPTS):
            reply = await self.scripts.reserve(
                tenant.tenant_id,
                tenant.limits,
                request_id,
                tokens,
                windows,
                self._lease_ms,
                self.owner_id,
                cost_nanos,
                tenant.budget,
            )
            self._offset_s = reply.server_now_s - self._clock()
            if reply.status != STATUS_STALE_WINDOWS:
                return reply
            windows = windows_at(reply.server_now_s)
        raise RuntimeError("the reserve script kept reporting stale windows")

    def _reserve_unchecked(
        self, tenant: Tenant, request_id: str, tokens: int, cost_nanos: int
    ) -> tuple[Reservation, RateLimitState]:
        decisions = unavailable_decisions(tenant.limits, self._policy, tenant.budget)
        for limit_class, decision in decisions.items():
            self._redis_errors.labels(limit_class=limit_class, decision=decision).inc()
        closed = [cls for cls, decision in decisions.items() if decision == "closed"]
        if closed:
            if self.journal is not None:
                # reserve.lua may have run with its reply lost (Redis went away mid-call): a
                # 0-token unchecked settlement voids that reservation once Redis is back (its
                # tokens refunded, its slot freed) and does nothing if it never ran.
                w = self._guess_windows()
                void = Settlement(
                    tenant.tenant_id, request_id, False, w.minute, w.day, 0, self.owner_id
                )
                self._journal(void, kind="void")
            raise QuotaUnavailable(UNAVAILABLE_RETRY_AFTER_S, limit_class=closed[0])
        reservation = Reservation(
            tenant.tenant_id,
            request_id,
            tokens,
            checked=False,
            owner_id=self.owner_id,
            cost_nanos=cost_nanos,
        )
        if self.journal is not None:  # charged the reservation if we die before reconcile
            self._journal(
                self._settlement(reservation, tokens, final=False, actual_cost=cost_nanos)
            )
        return reservation, unlimited_state()

    def _settlement(
        self,
        reservation: Reservation,
        actual: int,
        *,
        final: bool = True,
        usage: str | None = None,
        actual_cost: int = 0,
    ) -> Settlement:
        r = reservation
        if r.checked and r.minute is not None and r.day is not None:
            return Settlement(
                r.tenant_id,
                r.request_id,
                True,
                r.minute,
                r.day,
                actual - r.tokens,
                r.owner_id,
                usage=usage,
                delta_cost_nanos=actual_cost - r.cost_nanos,
            )
        w = self._guess_windows()
        return Settlement(
            r.tenant_id,
            r.request_id,
            False,
            w.minute,
            w.day,
            actual,
            r.owner_id,
            final,
            usage,
            delta_cost_nanos=actual_cost,
        )

    def _journal(self, settlement: Settlement, kind: str | None = None) -> None:
        assert self.journal is not None
        self.journal.put(settlement)
        kind = kind or ("checked" if settlement.checked else "unchecked")
        self._journaled.labels(kind=kind).inc()

    def _guess_windows(self) -> Windows:
        return windows_at(self._clock() + self._offset_s)

    def _note_down(self, exc: Exception) -> None:
        if not self._redis_down:
            self._redis_down = True
            log.warning("quota: Redis unreachable (%r); applying the failure policy", exc)

    def _note_up(self) -> None:
        if self._redis_down:
            self._redis_down = False
            log.info("quota: Redis reachable again; quotas are enforced")
