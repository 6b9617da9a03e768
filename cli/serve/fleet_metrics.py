"""`switchyard_autoscaler_desired_replicas{pool}` on the serve gateway's /metrics.

The autoscaler's desired replica count per pool, read at scrape time: on a single host,
its own autoscaler's last decision; on a fleet (`serve --join`), the leader's, as the
leader last published it in Redis (every host's gateway exports the same value, so a
scaler may scrape any of them: `max by (pool)`). KEDA's Prometheus scaler or an HPA
external metric scales a pool's worker Deployment on it (deploy/kubernetes/).
"""

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

DESIRED_REPLICAS = "switchyard_autoscaler_desired_replicas"


class DesiredReplicas(Collector):
    """`desired()`: pool -> replicas; a pool without a decision yet is left out."""

    def __init__(self, desired: Callable[[], dict[str, int]]) -> None:
        self._desired = desired

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            DESIRED_REPLICAS,
            "Replicas the fleet's autoscaler wants for a pool (its last decision, after its "
            "windows and min/max bounds).",
            labels=["pool"],
        )
        for pool, num in sorted(self._desired().items()):
            family.add_metric([pool], num)
        yield family


def export_desired_replicas(
    registry: CollectorRegistry, desired: Callable[[], dict[str, int]]
) -> None:
    registry.register(DesiredReplicas(desired))
