"""The actuator: what carries out the autoscaler's decisions.

The policy only says "order N replicas of pool P" and "drain replica X". An actuator
makes that true somewhere: local worker processes (the supervisor of `switchyard
serve`), a Kubernetes Deployment (docs/architecture.md, "Fleet and autoscaler"), or
the simulator of `switchyard bench autoscale`. Nothing here knows which.
"""

import itertools
from dataclasses import dataclass, field
from typing import Protocol

from workers.fleet.autoscaler import Decision
from workers.fleet.signals import ReplicaState


class Actuator(Protocol):
    """Both methods return promptly; the work they start shows up in later signals."""

    def start_replica(self, pool: str) -> str:
        """Order one replica of `pool` and return its id. From now until it is ready, the
        signals list it as `starting` (it counts as capacity already ordered); once its
        `/ready` answers 200, as `ready`. A replica that fails to start is reported
        gone (dropped from the signals) and the next tick orders another."""
        ...

    def drain_replica(self, pool: str, replica_id: str) -> None:
        """Retire one replica without cutting anyone off: it stops admitting
        (`POST /drain`), the gateway stops sending to it (its `/load` says `draining`),
        it finishes its resident sequences, then exits and leaves the signals. A
        `starting` replica is cancelled outright. Idempotent; an unknown id is ignored."""
        ...


def apply_decision(decision: Decision, actuator: Actuator) -> list[str]:
    """Carry out one decision: drains first, then starts; the ids of replicas ordered."""
    for replica_id in decision.drain:
        actuator.drain_replica(decision.pool, replica_id)
    return [actuator.start_replica(decision.pool) for _ in range(decision.num_start)]


@dataclass
class RecordingActuator:
    """A fake for tests: remembers every call and the state it implies.

    `mark(replica_id, state)` and `remove(replica_id)` stand in for a replica becoming
    ready, stalling, or exiting after its drain.
    """

    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (verb, pool, id)
    states: dict[str, tuple[str, ReplicaState]] = field(default_factory=dict)  # id: pool, st
    _ids: itertools.count = field(default_factory=itertools.count)

    def start_replica(self, pool: str) -> str:
        replica_id = f"{pool}-{next(self._ids)}"
        self.calls.append(("start", pool, replica_id))
        self.states[replica_id] = (pool, "starting")
        return replica_id

    def drain_replica(self, pool: str, replica_id: str) -> None:
        self.calls.append(("drain", pool, replica_id))
        if replica_id not in self.states:
            return
        if self.states[replica_id][1] == "starting":
            del self.states[replica_id]
        else:
            self.states[replica_id] = (pool, "draining")

    def mark(self, replica_id: str, state: ReplicaState) -> None:
        self.states[replica_id] = (self.states[replica_id][0], state)

    def remove(self, replica_id: str) -> None:
        self.states.pop(replica_id, None)

    def replicas(self, pool: str) -> dict[str, ReplicaState]:
        return {rid: st for rid, (p, st) in self.states.items() if p == pool}
