"""What the autoscaler reads: one snapshot of a pool and its replicas.

The supervisor builds a `PoolSignals` per pool on every tick from the gateway's view of
the pool (queue, arrivals, completions, TTFT) and each replica's `GET /load`. `None`
everywhere means "not measured" (a replica still starting, a worker that did not answer,
a window with no completions yet). The autoscaler never scales down on a `None`.

Counts are requests (sequences); token counts are tokens; times are seconds on the
supervisor's clock (`time.monotonic()` in production, a number in tests).
"""

from dataclasses import asdict, dataclass
from typing import Any, Literal

# `starting`: ordered, not yet ready (process launched, model loading, pod pending).
# `ready`: serving. `draining`: told to stop admitting; finishing resident sequences.
# `stalled`: resident work and no engine progress: not serving and not a victim, but
# capacity already ordered (the supervisor restarts it), so never replaced.
ReplicaState = Literal["starting", "ready", "draining", "stalled"]


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    """One replica of a pool, as the supervisor last saw it."""

    replica_id: str  # stable id the actuator gave it (process id, pod name, URL)
    state: ReplicaState
    ordered_at_s: float  # when it was ordered, on the supervisor's clock
    num_running: int | None = None  # sequences in the engine; None: no /load answer
    num_waiting: int | None = None  # sequences in the worker's own short line
    kv_used_tokens: int | None = None  # resident KV, tokens: drain cost of this replica
    kv_total_tokens: int | None = None  # KV capacity, tokens

    @property
    def has_metrics(self) -> bool:
        return self.num_running is not None and self.kv_used_tokens is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One pool at one instant. Rates are over the gateway's short window (a few s)."""

    pool: str
    replicas: tuple[ReplicaSignals, ...]
    queue_depth: int | None = None  # requests waiting in the gateway's queue for the pool
    estimated_wait_s: float | None = None  # what a request entering the queue now waits
    arrivals_per_s: float | None = None  # requests offered to the pool (queued or refused)
    mean_service_s: float | None = None  # mean seconds a request held a worker slot
    ttft_p90_s: float | None = None  # time to first token, p90 over the short window
    # More replicas the host's free devices can place now (None: not bounded by devices).
    startable: int | None = None

    def in_state(self, *states: ReplicaState) -> list[ReplicaSignals]:
        return [r for r in self.replicas if r.state in states]

    @property
    def num_ordered(self) -> int:
        """Capacity already ordered: ready, starting (restarting included) and stalled (the
        supervisor restarts it; a replacement would be one replica too many once it is
        back). Draining replicas are not: they are leaving."""
        return len(self.in_state("ready", "starting", "stalled"))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["replicas"] = [r.to_dict() for r in self.replicas]
        return out
