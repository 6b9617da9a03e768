"""Prometheus metrics of the gateway, on the registry the process builds."""

from prometheus_client import CollectorRegistry, Counter, Histogram

P = "switchyard_gateway_"
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


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            P + "requests",
            "Requests answered, by pool, route and HTTP status.",
            ["pool", "route", "status"],
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
