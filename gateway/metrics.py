"""Prometheus metrics of the gateway, on the registry the process builds.

Label cardinality is bounded: `tenant` is a tenant id only for tenants on the allow-list or,
first come, up to `tenant_cap` others; every other tenant is `other`. No metric carries a key,
a key id or any prompt text. Pools, routes and statuses are closed sets of the config.

Several gateway replicas: each serves its own `/metrics` and Prometheus sums the targets
(`sum without (instance)`). A replica of several processes on one port (`--workers N`)
answers a scrape for all of its processes, each sample labelled `process`
(`gateway/runtime/group_metrics.py`), not through prometheus-client's multiprocess mode, which
would not carry the scrape-time collectors (queue depth).

The exposition names tenants and their traffic, so `MetricsAccess` decides who may read it.
"""

import hmac
import ipaddress
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from quota.budget import NANOS

P = "switchyard_gateway_"
OTHER_TENANT = "other"
_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)


class TenantLabels:
    """The `tenant` label value: the id for tenants on `allow`, or for the first `cap` others
    seen by this process; `other` for the rest."""

    def __init__(self, allow: Collection[str] = (), cap: int = 20) -> None:
        self._allow = frozenset(allow)
        self._cap = max(0, cap)
        self._seen: set[str] = set()

    def __call__(self, tenant_id: str) -> str:
        if tenant_id in self._allow or tenant_id in self._seen:
            return tenant_id
        if len(self._seen) < self._cap:
            self._seen.add(tenant_id)
            return tenant_id
        return OTHER_TENANT


class MetricsAccess:
    """Who may read `/metrics`: a peer whose address is in `networks` (CIDRs; the gateway's
    default is loopback), or a request carrying `Authorization: Bearer <token>` (compared
    in constant time; no token configured: none does). The peer is the connection's, or
    the `X-Forwarded-For` one where uvicorn trusts the proxy (loopback by default); a
    proxy on this host that does not set it makes every client look local."""

    def __init__(self, token: str | None, networks: Iterable[str]) -> None:
        if isinstance(networks, str):
            raise ValueError(f"metrics_networks is a list of CIDRs, not {networks!r}")
        self._token = token.encode() if token else None
        # ValueError for a network that does not parse: the process does not start.
        self._networks = tuple(ipaddress.ip_network(n, strict=False) for n in networks)

    def allows(self, peer: str | None, authorization: str) -> bool:
        if self._token is not None and authorization[:7].lower() == "bearer ":
            if hmac.compare_digest(authorization[7:].strip().encode(), self._token):
                return True
        if peer is None or not self._networks:
            return False
        try:
            address = ipaddress.ip_address(peer.split("%", 1)[0])
        except ValueError:
            return False  # not an IP peer (a unix socket, a test client's name)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in net for net in self._networks)


# The reasons a pool refuses before any token (`gateway.capacity.pool.refusal_reason`),
# exported at 0 until one happens so `rate()` sees every series from the start.
REFUSAL_REASONS = ("predicted", "late", "queue_full", "deadline", "no_replica")


class _PoolCollector(Collector):
    """Per pool, read at scrape time: queue depth, replicas, and the capacity model and its
    decisions (`gateway.capacity.pool.Pool`: targets, predicted TTFT, refusals, goodput)."""

    def __init__(self, pools: Callable[[], dict[str, Any]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            P + "queue_depth", "Requests waiting in the gateway's queue, per pool.", labels=["pool"]
        )
        replicas = GaugeMetricFamily(
            P + "pool_replicas",
            "Replicas of a pool by state (as polled).",
            labels=["pool", "state"],
        )
        pools = self._pools()
        for name, pool in pools.items():
            depth.add_metric([name], pool.controller.num_waiting)
            states: dict[str, int] = {}
            for view in pool.views.values():
                states[view.state] = states.get(view.state, 0) + 1
            for state, num in states.items():
                replicas.add_metric([name, state], num)
        yield depth
        yield replicas
        yield from _capacity_families(pools)


def _capacity_families(pools: dict[str, Any]) -> Iterator[Metric]:
    """The capacity model of each pool and what it decided (`Pool.refusals`, `Pool.goodput`)."""
    refusals = CounterMetricFamily(
        P + "refusals",
        "Requests a pool refused before any token, by reason: predicted (over its TTFT target "
        "at arrival), late (its latest start passed in the queue), queue_full, deadline, "
        "no_replica.",
        labels=["pool", "reason"],
    )
    served = CounterMetricFamily(
        P + "served_requests",
        "Requests a pool's worker answered to their end (status 200), streams and not.",
        labels=["pool"],
    )
    goodput = CounterMetricFamily(
        P + "goodput_requests",
        "Served requests that met their targets: a stream's first token within its TTFT "
        "target and no gap between tokens past the pool's ITL target (none reported: TTFT "
        "alone); a non-stream's whole answer within TTFT target + tokens x ITL target.",
        labels=["pool"],
    )
    predicted = GaugeMetricFamily(
        P + "predicted_ttft_seconds",
        "Predicted arrival to first token, at scrape time, of a typical request (the mean "
        "size of the pool's served requests) of a tenant with nothing waiting, from the "
        "capacity model admission uses; absent without a capacity model.",
        labels=["pool"],
    )
    ttft_target = GaugeMetricFamily(
        P + "ttft_target_seconds",
        "The pool's TTFT target (priority 0's; absent: none, admission by counts only).",
        labels=["pool"],
    )
    itl_target = GaugeMetricFamily(
        P + "itl_target_seconds",
        "The ITL target the pool's workers report in /load (the strictest; absent: none).",
        labels=["pool"],
    )
    ratio = GaugeMetricFamily(
        P + "completion_ratio",
        "Output tokens generated per max_tokens allowed, over recent requests (EWMA), as "
        "admission expects of a request.",
        labels=["pool"],
    )
    for name, pool in pools.items():
        counts = {reason: 0 for reason in REFUSAL_REASONS} | pool.refusals
        for reason, num in counts.items():
            refusals.add_metric([name, reason], num)
        served.add_metric([name], pool.goodput.served)
        goodput.add_metric([name], pool.goodput.met)
        ttft_s = pool.typical_ttft_s()
        if ttft_s is not None:
            predicted.add_metric([name], ttft_s)
        if pool.ttft_target_s is not None:
            ttft_target.add_metric([name], pool.ttft_target_s)
        if pool.itl_target_s is not None:
            itl_target.add_metric([name], pool.itl_target_s)
        ratio.add_metric([name], pool.completion_ratio)
    yield from (refusals, served, goodput, predicted, ttft_target, itl_target, ratio)


class _KeptChildren:
    """A labelled metric whose children are kept by their label values, so `labels(...)`
    is one dict lookup after the first time (prometheus-client validates the values and
    takes a lock on every call: several times per request here). The gateway never
    removes a child, and every label is of a bounded set (see the module's docstring)."""

    __slots__ = ("_metric", "_children")

    def __init__(self, metric: MetricWrapperBase) -> None:
        self._metric = metric
        self._children: dict[tuple, Any] = {}

    def labels(self, *values: str, **by_name: str) -> Any:
        if by_name:
            return self._metric.labels(*values, **by_name)
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metric, name)


class GatewayMetrics:
    def __init__(
        self, registry: CollectorRegistry, tenant_labels: TenantLabels | None = None
    ) -> None:
        self.registry = registry
        self.tenant = tenant_labels or TenantLabels()
        self.requests = Counter(
            P + "requests",
            "Requests answered, by pool, route and HTTP status.",
            ["pool", "route", "status"],
            registry=registry,
        )
        self.tenant_requests = Counter(
            P + "tenant_requests",
            "Settled requests by tenant, pool served and status (499: client gone mid-answer).",
            ["tenant", "model", "status"],
            registry=registry,
        )
        self.tokens = Counter(
            P + "tokens",
            "Tokens charged by tenant and pool served; kind: prompt, completion, cached "
            "(prompt tokens the worker's prefix cache served).",
            ["tenant", "model", "kind"],
            registry=registry,
        )
        self.quota_refusals = Counter(
            P + "quota_refusals",
            "Requests refused by a tenant's quota, by the limit that refused.",
            ["tenant", "limit"],
            registry=registry,
        )
        self.spend = Counter(
            P + "spend",
            "Money charged to tenants (units of the gateway's currency), by tenant and the "
            "pool that served.",
            ["tenant", "model"],
            registry=registry,
        )
        self.shadow_spend = Counter(
            P + "shadow_spend",
            "What shadow runs cost at the pool's price (the operator's, not a tenant's).",
            ["pool"],
            registry=registry,
        )
        self.budget_refusals = Counter(
            P + "budget_refusals",
            "Requests refused because their worst-case cost would pass a hard money budget "
            "(the tenant's or its key's).",
            ["tenant"],
            registry=registry,
        )
        self.budget_soft_crossings = Counter(
            P + "budget_soft_crossings",
            "Soft money budgets crossed (once per budget period; the tenant's or a key's).",
            ["tenant"],
            registry=registry,
        )
        self.budget_remaining = Gauge(
            P + "budget_remaining",
            "A tenant's hard budget less its spend this period (reservations in flight "
            "counted at their worst case), as of its last request through this gateway.",
            ["tenant"],
            registry=registry,
        )
        self.budget_spent_ratio = Gauge(
            P + "budget_spent_ratio",
            "A tenant's spend this period over its hard budget (1: reached), as of its last "
            "request through this gateway.",
            ["tenant"],
            registry=registry,
        )
        self.shed = Counter(
            P + "shed_requests",
            "Requests shed by the gateway (503: queue full, deadline in queue, no replica).",
            ["pool"],
            registry=registry,
        )
        self.resumes = Counter(
            P + "resumes",
            "Streams that went on on another replica after theirs failed mid-answer "
            "(reason: lost, the connection broke; idle, silent past the idle bound; drain, "
            "its worker handed it over once its drain's grace was over).",
            ["pool", "reason"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            P + "queue_wait_seconds",
            "Time from enqueue to dispatch.",
            ["pool"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            P + "request_latency_seconds",
            "Arrival to response start (non-streaming: whole).",
            ["pool"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Streams: arrival at the gateway to the first token relayed to the client.",
            ["pool"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Streams: time between tokens relayed to the client.",
            ["pool"],
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Reservation to settlement of every admitted request, as the client sees it.",
            ["pool"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.overhead = Histogram(
            P + "overhead_seconds",
            "The gateway's own time before queueing: auth, decode, count, route, reserve.",
            ["pool"],
            buckets=_FAST_BUCKETS,
            registry=registry,
        )
        self.redis_latency = Histogram(
            P + "redis_latency_seconds",
            "Redis calls on the request path, by operation (auth, reserve, reconcile).",
            ["op"],
            buckets=_FAST_BUCKETS,
            registry=registry,
        )
        self.redis_errors = Counter(
            P + "redis_errors",
            "Redis calls on the request path that failed, by operation.",
            ["op"],
            registry=registry,
        )
        self.door_refusals = Counter(
            P + "door_refusals",
            "Requests refused at the door (429 gateway_busy): the tenant was over its share "
            "and waited door_max_wait_s, or its lane was full (gateway/capacity/door.py).",
            ["tenant"],
            registry=registry,
        )
        self.door_limit = Gauge(
            P + "door_limit",
            "Requests the tenants over their share may have in flight in this process, "
            "adapted to the other tenants' latency (gateway/capacity/door.py).",
            registry=registry,
        )
        self.door_waiting = Gauge(
            P + "door_waiting",
            "Requests of over-share tenants waiting in their lanes at the door.",
            registry=registry,
        )
        self.loop_lag = Gauge(
            P + "event_loop_lag_seconds",
            "How late a 20 ms timer fires on this process's event loop (smoothed).",
            registry=registry,
        )
        for name, metric in vars(self).items():
            if isinstance(metric, MetricWrapperBase) and metric._labelnames:
                setattr(self, name, _KeptChildren(metric))

    def watch_pools(self, pools: Callable[[], dict[str, Any]]) -> None:
        """Export queue depth and replicas per pool of `pools()` at scrape time."""
        self.registry.register(_PoolCollector(pools))

    def observe_outcome(self, tenant_id: str, outcome: Any) -> None:
        """One settled request (`gateway.serving.flight.Outcome`)."""
        tenant = self.tenant(tenant_id)
        self.tenant_requests.labels(tenant, outcome.model, str(outcome.status)).inc()
        self.e2e.labels(outcome.model).observe(outcome.latency_ms / 1000)
        for part in outcome.parts:
            self.tokens.labels(tenant, part.model, "prompt").inc(part.prompt_tokens)
            self.tokens.labels(tenant, part.model, "completion").inc(part.completion_tokens)
            self.tokens.labels(tenant, part.model, "cached").inc(part.cached_tokens)
            if part.cost_nanos:
                self.spend.labels(tenant, part.model).inc(part.cost_nanos / NANOS)
