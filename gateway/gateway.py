"""The gateway's collaborators, built once by the process entry point and passed down."""

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.capacity.door import Gate
from gateway.capacity.pool import Pool
from gateway.config import GatewayConfig
from gateway.learning.router import Router
from gateway.metrics import GatewayMetrics
from gateway.serving.prompt_tokens import PromptCounter
from quota.limiter import QuotaLimiter, Reservation
from quota.store import TenantStore
from quota.sweeper import QuotaMaintenance
from quota.usage import UsageReader, usage_record
from workers.api.client import WorkerClient
from workers.api.types import ApiError

log = logging.getLogger(__name__)


@dataclass
class Gateway:
    config: GatewayConfig
    store: TenantStore
    limiter: QuotaLimiter
    maintenance: QuotaMaintenance  # heartbeat, journal replay, dead-owner sweeps
    pools: dict[str, Pool]
    counter: PromptCounter
    workers: WorkerClient  # the one client for every worker of every pool
    registry: CollectorRegistry
    redis: Any  # redis.asyncio.Redis
    rng: random.Random = field(default_factory=random.Random)
    metrics: "GatewayMetrics | None" = None
    router: "Router | None" = None  # the cascade, for `model: auto`
    usage: "UsageReader | None" = None  # usage history (None: only the current windows)
    # gateway.learning.learner.Learner: labels from traffic (None: not collected)
    learner: Any = None
    gate: Gate | None = None  # the door's; fed each request's latency to its reservation
    # Per pool, what a fleet supervisor in this process knows (replicas, the autoscaler's
    # last decision), merged into GET /admin/fleet; None: the pools are static URL lists.
    fleet_status: "Callable[[], dict[str, Any]] | None" = None
    # Keys that authenticated recently (digest -> (caller, monotonic time)): taken without
    # a Redis lookup for `key_cache_ttl_s`, and while Redis is unreachable for
    # `known_key_ttl_s` (a known key keeps working through an outage, an unknown one never).
    known_keys: dict[bytes, tuple[Any, float]] = field(default_factory=dict)
    keys_changed_at: float = 0.0  # an admin change through this process: older entries stale
    # A key's Redis lookup in progress (digest -> its outcome): the requests that miss the
    # cache meanwhile wait for it instead of each sending their own.
    key_lookups: dict[bytes, "asyncio.Future[Any]"] = field(default_factory=dict)
    _background: set[asyncio.Task] = field(default_factory=set)
    # requests not settled yet (gateway.serving.flight)
    flights: set[Any] = field(default_factory=set)

    def keys_changed(self) -> None:
        """A key or tenant changed through this process's admin API: its next request
        reads Redis (other processes see the change within `key_cache_ttl_s`)."""
        self.keys_changed_at = time.monotonic()

    def cache_salt(self, tenant_id: str) -> str:
        """Prefix-cache namespace per tenant: one tenant's cached prompts never serve another."""
        return hashlib.blake2b(tenant_id.encode(), digest_size=8).hexdigest()

    def spawn(self, coro) -> asyncio.Task:  # noqa: ANN001 (any coroutine)
        """Run `coro` outside the caller's (possibly cancelled) task; awaited at shutdown."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def reconcile_later(
        self, reservation: Reservation, actual_tokens: int, flight: Any = None
    ) -> None:
        """Reconcile outside the request's (possibly cancelled) task, exactly once.
        `flight` (a `gateway.serving.flight.Flight`): its outcome is recorded as usage (in the same
        Redis call) and counted in the metrics; it is read when the task runs, after the
        handler that finished it has set the response status."""
        self.spawn(self._reconcile(reservation, actual_tokens, flight))

    async def _reconcile(self, reservation: Reservation, actual_tokens: int, flight: Any) -> None:
        usage = None
        try:
            if flight is not None:
                outcome = flight.outcome()
                if self.metrics is not None:
                    self.metrics.observe_outcome(reservation.tenant_id, outcome)
                for part in outcome.parts:
                    if part.model in self.pools:
                        self.pools[part.model].record_tokens(part.completion_tokens)
                usage = usage_record(
                    request_id=reservation.request_id,
                    key_id=flight.key_id,
                    model=outcome.model,
                    route=outcome.route,
                    status=outcome.status,
                    latency_ms=outcome.latency_ms,
                    parts=outcome.parts,
                    finished_at_s=time.time(),
                )
        except Exception:
            log.exception("usage of %s not recorded", reservation.request_id)
        try:
            t0 = time.perf_counter()
            try:
                await self.limiter.reconcile(reservation, actual_tokens, usage)
            except Exception:
                if usage is None:
                    raise
                # A usage record the script refuses must not cost the settlement itself.
                log.exception("usage of %s refused; settling without it", reservation.request_id)
                await self.limiter.reconcile(reservation, actual_tokens)
            if self.metrics is not None:
                self.metrics.redis_latency.labels("reconcile").observe(time.perf_counter() - t0)
        except Exception:
            if self.metrics is not None:
                self.metrics.redis_errors.labels("reconcile").inc()
            log.exception("reconcile failed for %s", reservation.request_id)

    def abort_flights(self) -> int:
        """Cut every request still in flight short (shutdown's grace is over): each answers
        its client with a 503 `shutting_down` (in-band on a committed stream) and settles.
        Returns how many were cut."""
        flights = list(self.flights)
        for flight in flights:
            flight.abort(
                ApiError(
                    503,
                    "the gateway is shutting down; retry the request",
                    type="server_error",
                    code="shutting_down",
                    retry_after_s=1.0 + self.rng.random(),
                )
            )
        if flights:
            log.warning("shutdown: cut %d requests still in flight", len(flights))
        return len(flights)

    async def settle_all(self, timeout_s: float = 10.0) -> None:
        """At shutdown: settle every request not settled yet (one whose task the server
        cancelled may not have run its `finally` yet), then wait for background work
        (reconciles, closes) until none is left, at most `timeout_s`."""
        for flight in list(self.flights):
            flight.finish()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._background:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                log.warning("shutdown: %d background tasks unfinished", len(self._background))
                return
            await asyncio.wait(set(self._background), timeout=remaining)
