"""The gateway's collaborators, built once by the process entry point and passed down."""

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gateway.billing.book import PriceBook
from gateway.billing.budgets import BudgetWebhook, SpendView
from gateway.billing.prices import prices_from_dict
from gateway.capacity.demand import DemandPublisher
from gateway.capacity.door import Gate
from gateway.capacity.membership import MembershipWatcher
from gateway.capacity.pool import Pool
from gateway.config import GatewayConfig
from gateway.learning.learner import Learner
from gateway.learning.router import Router
from gateway.metrics import GatewayMetrics
from gateway.serving.counting import CountingPool
from gateway.serving.flight import Flight
from gateway.serving.plan import Plan, PublicRequest, upstream_body
from gateway.serving.prompt_tokens import PromptCounter
from gateway.serving.record import Outcome
from quota.limiter import QuotaLimiter, Reservation
from quota.models import Tenant
from quota.store import TenantStore
from quota.sweeper import QuotaMaintenance
from quota.usage import UsageReader, usage_record
from workers.api.client import WorkerClient
from workers.api.types import ApiError

log = logging.getLogger(__name__)

# An authenticated caller: the key's id, its tenant, and the key's own quota holder (its
# limits and budget, `serving.intake.key_quota_holder`; None: the key has neither).
Caller = tuple[str | None, Tenant, Tenant | None]


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
    redis: Redis
    rng: random.Random = field(default_factory=random.Random)
    metrics: "GatewayMetrics | None" = None
    router: "Router | None" = None  # the cascade, for `model: auto`
    usage: "UsageReader | None" = None  # usage history (None: only the current windows)
    learner: Learner | None = None  # labels from traffic (None: not collected)
    gate: Gate | None = None  # the door's; fed each request's latency to its reservation
    # Threads for counting big prompts, fair by tenant; None: built from the config.
    counting: CountingPool | None = None
    # Per pool, what a fleet supervisor in this process knows (replicas, the autoscaler's
    # last decision), merged into GET /admin/fleet; None: the pools are static URL lists.
    fleet_status: "Callable[[], dict[str, Any]] | None" = None
    # Members announced in the fleet's Redis (gateway/capacity/membership.py); None: off.
    membership: MembershipWatcher | None = None
    # This process's demand, published for the fleet's leader (capacity/demand.py); None:
    # not published (membership off, or a serve host, whose host record carries it).
    demand: DemandPublisher | None = None
    # Keys that authenticated recently (digest -> (caller, monotonic time)): taken without
    # a Redis lookup for `key_cache_ttl_s`, and while Redis is unreachable for
    # `known_key_ttl_s` (a known key keeps working through an outage, an unknown one never).
    known_keys: dict[bytes, tuple[Caller, float]] = field(default_factory=dict)
    keys_changed_at: float = 0.0  # an admin change through this process: older entries stale
    # A key's Redis lookup in progress (digest -> its outcome): the requests that miss the
    # cache meanwhile wait for it instead of each sending their own.
    key_lookups: dict[bytes, "asyncio.Future[Caller]"] = field(default_factory=dict)
    # Prices per pool (None: built from the config, unpriced unless it names prices), what
    # this process last saw of each tenant's spend, and the soft-budget webhook.
    # (None: built from the config at init; never None after.)
    prices: PriceBook = None  # type: ignore[assignment]
    spend: SpendView = field(default_factory=SpendView)
    webhook: BudgetWebhook = None  # type: ignore[assignment]
    _background: set[asyncio.Task[Any]] = field(default_factory=set)
    flights: set[Flight] = field(default_factory=set)  # requests inside their flight's block

    def __post_init__(self) -> None:
        cfg = self.config
        if self.counting is None:
            self.counting = CountingPool(
                cfg.count_threads, cfg.count_per_tenant, cfg.count_lane_max, self.rng
            )
        for pool in self.pools.values():
            pool.start_grace_s = cfg.replica_start_grace_s
        kinds = {name: pool.kind for name, pool in self.pools.items()}
        if self.prices is None:
            self.prices = PriceBook(
                self.redis, prices_from_dict(cfg.prices, kinds), kinds, cfg.currency
            )
        if self.webhook is None:
            self.webhook = BudgetWebhook(cfg.budget_webhook_url, cfg.currency)

    def keys_changed(self) -> None:
        """A key or tenant changed through this process's admin API: its next request
        reads Redis (other processes see the change within `key_cache_ttl_s`)."""
        self.keys_changed_at = time.monotonic()

    def cache_salt(self, tenant_id: str) -> str:
        """Prefix-cache namespace per tenant: one tenant's cached prompts never serve another."""
        return hashlib.blake2b(tenant_id.encode(), digest_size=8).hexdigest()

    def body_for(
        self,
        req: PublicRequest,
        plan: Plan,
        pool: str | None = None,
        with_logprobs: bool = False,
        token_ids: bool = False,
    ) -> bytes:
        """The body sent to `pool` (default: the plan's) for `req`: shaped for the pool's
        kind of server and named as it serves the model (`plan.upstream_body`)."""
        target = self.pools[pool or plan.pool]
        return upstream_body(
            req,
            plan,
            self.cache_salt(plan.tenant_id),
            pool=target.name,
            with_logprobs=with_logprobs,
            kind=target.kind,
            model=target.upstream_model,
            token_ids=token_ids,
        )

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> "asyncio.Task[Any]":
        """Run `coro` outside the caller's (possibly cancelled) task; awaited at shutdown."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def reconcile_later(
        self,
        reservation: Reservation,
        actual_tokens: int,
        outcome: Outcome | None = None,
        cost_nanos: int = 0,
    ) -> None:
        """Reconcile outside the request's (possibly cancelled) task, exactly once.
        `outcome`: how the request ended, handed over by its settled flight, recorded as
        usage (in the same Redis call) and counted in the metrics. None: no usage record (a
        key's own windows, or a reservation given back unused). `cost_nanos`: the money it
        cost (0: the reserved cost is given back)."""
        self.spawn(self._reconcile(reservation, actual_tokens, outcome, cost_nanos))

    async def _reconcile(
        self,
        reservation: Reservation,
        actual_tokens: int,
        outcome: Outcome | None,
        cost_nanos: int,
    ) -> None:
        usage = None
        try:
            if outcome is not None:
                if self.metrics is not None:
                    self.metrics.observe_outcome(reservation.tenant_id, outcome)
                usage = usage_record(
                    request_id=reservation.request_id,
                    key_id=outcome.key_id,
                    model=outcome.model,
                    route=outcome.route,
                    status=outcome.status,
                    latency_ms=outcome.latency_ms,
                    parts=outcome.parts,
                    finished_at_s=time.time(),
                    auto=outcome.auto,
                )
        except Exception:
            log.exception("usage of %s not recorded", reservation.request_id)
        try:
            t0 = time.perf_counter()
            try:
                await self.limiter.reconcile(reservation, actual_tokens, usage, cost_nanos)
            except Exception:
                if usage is None:
                    raise
                # A usage record the script refuses must not cost the settlement itself.
                log.exception("usage of %s refused; settling without it", reservation.request_id)
                await self.limiter.reconcile(reservation, actual_tokens, None, cost_nanos)
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
        """At shutdown: wait until every request has settled (a task the server cancelled
        settles when it next runs, leaving its flight's block) and background work
        (reconciles, closes) is done, at most `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.flights or self._background:
            remaining = deadline - loop.time()
            if remaining <= 0:
                log.warning(
                    "shutdown: %d requests unsettled, %d background tasks unfinished",
                    len(self.flights),
                    len(self._background),
                )
                return
            if self._background:
                await asyncio.wait(set(self._background), timeout=min(remaining, 0.05))
            else:
                await asyncio.sleep(min(remaining, 0.01))
