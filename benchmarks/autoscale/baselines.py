"""Policies to compare the autoscaler with in `switchyard bench autoscale`.

Each is a `Policy` (signals, now_s) -> Decision, run through the same simulator:
a static pool, a Kubernetes-HPA-like utilisation ratio, and two oracles that read the
trace itself (what a policy could do if it knew the future).
"""

import math
from collections import deque

from benchmarks.autoscale.simulate import Policy, SimConfig, Trace
from workers.fleet.autoscaler import Decision, plan_change
from workers.fleet.signals import PoolSignals


def static_policy(num_replicas: int) -> Policy:
    def policy(signals: PoolSignals, now_s: float) -> Decision:
        return plan_change(signals, num_replicas, now_s, num_replicas, f"static {num_replicas}")

    return policy


class HpaRatioPolicy:
    """The HPA formula: desired = ceil(current x utilisation / target), where utilisation
    is busy slots over the ready replicas' slots (a saturated replica reads 100 % however
    long its queue), current counts ready and starting replicas; a 15 s sync period,
    10 % tolerance, scale-up at most max(2x, +4) per sync, and a 300 s scale-down
    stabilisation window (the highest recommendation in it)."""

    def __init__(
        self,
        config: SimConfig,
        target_utilization: float = 0.8,
        sync_period_s: float = 15.0,
        tolerance: float = 0.1,
        downscale_window_s: float = 300.0,
    ) -> None:
        self.config = config
        self.target = target_utilization
        self.sync_period_s = sync_period_s
        self.tolerance = tolerance
        self.window_s = downscale_window_s
        self._history: deque[tuple[float, int]] = deque()
        self._last_sync_s = -math.inf

    def __call__(self, signals: PoolSignals, now_s: float) -> Decision:
        ordered = signals.num_ordered
        if now_s - self._last_sync_s < self.sync_period_s:
            return plan_change(signals, ordered, now_s, ordered, "between syncs")
        self._last_sync_s = now_s
        busy = [
            r.num_running / self.config.capacity_per_replica
            for r in signals.in_state("ready")
            if r.num_running is not None
        ]
        rec = ordered
        if busy:
            ratio = sum(busy) / len(busy) / self.target
            if abs(ratio - 1) > self.tolerance:
                rec = min(math.ceil(ordered * ratio - 1e-9), max(2 * ordered, ordered + 4))
        rec = min(max(rec, self.config.min_replicas), self.config.max_replicas)
        self._history.append((now_s, rec))
        while self._history[0][0] < now_s - self.window_s:
            self._history.popleft()
        desired = rec if rec >= ordered else max(n for _, n in self._history)
        return plan_change(signals, desired, now_s, rec, f"utilisation ratio -> {rec}")


def oracle_policy(trace: Trace, config: SimConfig, lead_s: float) -> Policy:
    """Orders, `lead_s` ahead, what the trace will need: with `lead_s` = the start-up
    time replicas are ready just in time; with a simulator whose start-up is 0 and
    `lead_s` = 0 they appear the instant they are needed."""

    def policy(signals: PoolSignals, now_s: float) -> Decision:
        ahead = lead_s + config.decide_every_s
        steps = max(math.ceil(ahead / config.dt_s), 1)
        need = max(
            config.needed(trace.rate_per_s(now_s + j * config.dt_s)) for j in range(steps + 1)
        )
        return plan_change(signals, need, now_s, need, f"oracle: the trace needs {need}")

    return policy
