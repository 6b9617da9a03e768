"""Signals built from a few numbers, for the fleet tests."""

from workers.fleet.autoscaler import AutoscalerConfig
from workers.fleet.signals import PoolSignals, ReplicaSignals, ReplicaState


def make_replica(
    replica_id: str,
    state: ReplicaState = "ready",
    num_running: int | None = 0,
    kv_used_tokens: int | None = 0,
    ordered_at_s: float = 0.0,
) -> ReplicaSignals:
    starting = state == "starting"
    return ReplicaSignals(
        replica_id=replica_id,
        state=state,
        ordered_at_s=ordered_at_s,
        num_running=None if starting else num_running,
        num_waiting=None if starting else 0,
        kv_used_tokens=None if starting else kv_used_tokens,
        kv_total_tokens=8000,
    )


def make_pool(
    num_ready: int = 2,
    num_starting: int = 0,
    running_each: int = 0,
    queue_depth: int | None = 0,
    arrivals_per_s: float | None = 0.0,
    mean_service_s: float | None = 4.0,
    ttft_p90_s: float | None = 0.2,
) -> PoolSignals:
    """A pool "small" with replicas r0.. ready and s0.. starting."""
    replicas = [make_replica(f"r{i}", num_running=running_each) for i in range(num_ready)]
    replicas += [make_replica(f"s{i}", "starting") for i in range(num_starting)]
    return PoolSignals(
        pool="small",
        replicas=tuple(replicas),
        queue_depth=queue_depth,
        estimated_wait_s=0.0,
        arrivals_per_s=arrivals_per_s,
        mean_service_s=mean_service_s,
        ttft_p90_s=ttft_p90_s,
    )


def make_config(**overrides: float) -> AutoscalerConfig:
    """8 slots per replica, 1..10 replicas, up window 2 s, down window 60 s, no tolerance."""
    base = dict(
        min_replicas=1,
        max_replicas=10,
        target_running_per_replica=8.0,
        backlog_drain_s=60.0,
        up_tolerance=0.0,
        scale_up_window_s=2.0,
        scale_down_window_s=60.0,
        ttft_slo_s=2.0,
    )
    base.update(overrides)
    return AutoscalerConfig(**base)  # type: ignore[arg-type]
