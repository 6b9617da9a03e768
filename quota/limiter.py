"""Token, request and concurrency quotas: reserve before dispatch, reconcile after.

The decisions run inside two Lua scripts (`quota/lua/`) on the Redis server clock; this module
builds their keys, reads their replies through `quota.policy`, and applies the failure policy
when Redis is unreachable.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import redis.asyncio
from prometheus_client import CollectorRegistry, Counter
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from quota import keyspace
from quota.errors import QuotaUnavailable
from quota.models import Tenant
from quota.policy import (
    DAY_TTL_S,
    MINUTE_TTL_S,
    PENDING_TTL_S,
    STATUS_ADMITTED,
    STATUS_STALE_WINDOWS,
    UNAVAILABLE_RETRY_AFTER_S,
    FailurePolicy,
    RateLimitState,
    ReserveReply,
    Windows,
    exceeded_error,
    limit_arg,
    parse_reserve_reply,
    rate_limit_state,
    unavailable_decisions,
    unlimited_state,
    windows_at,
)

__all__ = ["FailurePolicy", "QuotaLimiter", "RateLimitState", "Reservation"]

log = logging.getLogger(__name__)

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)
_RESERVE_ATTEMPTS = 3  # a stale-window retry twice in a row needs two window rolls


def _script(name: str) -> str:
    return resources.files("quota").joinpath("lua", name).read_text()


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


class QuotaLimiter:
    """Reserves and reconciles tokens against a tenant's limits in Redis.

    `redis` should fail fast (small socket timeouts, few retries): while Redis is unreachable,
    `reserve` waits for the client's retries before the failure policy applies. `registry`:
    where the Prometheus counters go (None: a private registry, nothing exported).
    `concurrency_lease_s`: a slot not released by reconcile frees itself after this long (a
    crashed gateway cannot leak slots); a request running longer loses its slot. `clock` (unix
    seconds) only guesses the server's windows; the server's own clock decides.
    """

    def __init__(
        self,
        redis: redis.asyncio.Redis,
        policy: FailurePolicy | None = None,
        registry: CollectorRegistry | None = None,
        concurrency_lease_s: float = 600.0,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if concurrency_lease_s <= 0:
            raise ValueError("concurrency_lease_s must be positive")
        self._redis = redis
        self._policy = policy or FailurePolicy()
        self._lease_ms = int(concurrency_lease_s * 1000)
        self._clock = clock
        self._offset_s = 0.0  # server clock - local clock, learnt from each reply
        self._redis_down = False
        self._reserve = redis.register_script(_script("reserve.lua"))
        self._reconcile = redis.register_script(_script("reconcile.lua"))
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
            "Reconciles lost to an unreachable Redis (the reservation stays charged)",
            registry=registry,
        )

    async def reserve(
        self, tenant: Tenant, request_id: str, tokens: int
    ) -> tuple[Reservation, RateLimitState]:
        """Charge `tokens` (prompt + max_tokens) and one request to every window of the tenant,
        and take a concurrency slot if it has max_concurrent: all or nothing.

        Raises QuotaExceeded (nothing charged) or, with Redis unreachable and a limited class
        failing closed, QuotaUnavailable. Failing open gives `checked=False` and a state of
        Nones. Every reservation must be reconciled, even at 0 tokens, to free its slot.
        """
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        try:
            reply, windows = await self._run_reserve(tenant, request_id, tokens)
        except REDIS_DOWN as exc:
            self._note_down(exc)
            return self._reserve_unchecked(tenant, request_id, tokens)
        self._note_up()
        if reply.status != STATUS_ADMITTED:
            raise exceeded_error(tenant.limits, reply)
        reservation = Reservation(
            tenant_id=tenant.tenant_id,
            request_id=request_id,
            tokens=tokens,
            minute=windows.minute,
            day=windows.day,
            holds_slot=tenant.limits.max_concurrent is not None,
        )
        return reservation, rate_limit_state(tenant.limits, reply)

    async def reconcile(self, reservation: Reservation, actual_tokens: int) -> None:
        """Correct the windows the reservation was charged to by (actual - reserved), clamped at
        zero, and release its concurrency slot. Idempotent: only the first call acts. Never
        raises for an unreachable Redis (logged and counted; the reservation stays charged and
        its slot frees at lease end). An unchecked reservation charges `actual_tokens` to the
        current windows instead, so usage during an outage is not lost."""
        if reservation.reconciled:
            return
        tid, rid = reservation.tenant_id, reservation.request_id
        actual = max(0, int(actual_tokens))
        if reservation.checked and reservation.minute is not None and reservation.day is not None:
            windows = Windows(reservation.minute, reservation.day)
            delta, once = actual - reservation.tokens, "1"
        else:
            windows, delta, once = self._guess_windows(), actual, "0"
        keys = [
            keyspace.tokens_minute(tid, windows.minute),
            keyspace.tokens_day(tid, windows.day),
            keyspace.concurrency(tid),
            keyspace.pending(tid, rid),
        ]
        try:
            await self._reconcile(keys, [delta, once, rid, MINUTE_TTL_S, DAY_TTL_S])
        except REDIS_DOWN as exc:
            self._note_down(exc)
            self._reconcile_errors.inc()
            return
        self._note_up()
        reservation.reconciled = True

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

    async def _run_reserve(
        self, tenant: Tenant, request_id: str, tokens: int
    ) -> tuple[ReserveReply, Windows]:
        tid, limits = tenant.tenant_id, tenant.limits
        windows = self._guess_windows()
        for _ in range(_RESERVE_ATTEMPTS):
            keys = [
                keyspace.tokens_minute(tid, windows.minute),
                keyspace.tokens_day(tid, windows.day),
                keyspace.requests_minute(tid, windows.minute),
                keyspace.concurrency(tid),
                keyspace.pending(tid, request_id),
            ]
            args = [
                windows.minute,
                windows.day,
                tokens,
                limit_arg(limits.tokens_per_minute),
                limit_arg(limits.tokens_per_day),
                limit_arg(limits.requests_per_minute),
                limit_arg(limits.max_concurrent),
                request_id,
                self._lease_ms,
                MINUTE_TTL_S,
                DAY_TTL_S,
                PENDING_TTL_S,
            ]
            reply = parse_reserve_reply(await self._reserve(keys, args))
            self._offset_s = reply.server_now_s - self._clock()
            if reply.status != STATUS_STALE_WINDOWS:
                return reply, windows
            windows = windows_at(reply.server_now_s)
        raise RuntimeError("the reserve script kept reporting stale windows")

    def _reserve_unchecked(
        self, tenant: Tenant, request_id: str, tokens: int
    ) -> tuple[Reservation, RateLimitState]:
        decisions = unavailable_decisions(tenant.limits, self._policy)
        for limit_class, decision in decisions.items():
            self._redis_errors.labels(limit_class=limit_class, decision=decision).inc()
        closed = [cls for cls, decision in decisions.items() if decision == "closed"]
        if closed:
            raise QuotaUnavailable(UNAVAILABLE_RETRY_AFTER_S, limit_class=closed[0])
        return Reservation(tenant.tenant_id, request_id, tokens, checked=False), unlimited_state()

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
