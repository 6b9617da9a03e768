"""The fleet: per-pool signals, the autoscaling policy, and the actuator interface.

Pure decision code: no torch, no HTTP, no processes (an import-linter contract holds
it). The supervisor of `switchyard serve` builds `PoolSignals`, calls
`Autoscaler.decide`, and hands the `Decision` to its `Actuator` with `apply_decision`;
docs/architecture.md ("Fleet and autoscaler") describes the loop.
"""

from workers.fleet.actuator import Actuator, RecordingActuator, apply_decision
from workers.fleet.autoscaler import (
    Autoscaler,
    AutoscalerConfig,
    Decision,
    choose_victims,
    plan_change,
    recommend,
)
from workers.fleet.signals import PoolSignals, ReplicaSignals, ReplicaState

__all__ = [
    "Actuator",
    "Autoscaler",
    "AutoscalerConfig",
    "Decision",
    "PoolSignals",
    "RecordingActuator",
    "ReplicaSignals",
    "ReplicaState",
    "apply_decision",
    "choose_victims",
    "plan_change",
    "recommend",
]
