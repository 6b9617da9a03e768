"""The autoscaling policy: pure functions of `PoolSignals` and a clock reading.

The target is absolute: the concurrency the pool's demand needs, divided by what one
replica should carry, rounded up. Never `current x ratio`, and never CPU or GPU
utilisation: a saturated replica reads 100 % busy however long the queue behind it is.

    demand_slots = max(arrivals_per_s x mean_service_s, running)   # Little's law
                 + (gateway queue + worker waiting) x mean_service_s / backlog_drain_s
    recommendation = clamp(max(ceil(demand_slots / target_running_per_replica),
                               ceil(kv_used / (target_kv_fraction x kv_per_replica))),
                           min_replicas, max_replicas)

`Autoscaler.decide` keeps each pool's recent recommendations. It scales up to the
lowest recommendation of the short window (a single noisy tick does not order a
replica) and down to the highest of the long window (one replica short costs every
waiting user's first token; one too many costs only money). Ready, starting and stalled
replicas are capacity already ordered, so a constant overload during a slow start keeps
one constant target instead of doubling at every tick, and a stall is restarted, not
replaced. What a decision starts fits: every replica of the pool, draining ones too,
within max_replicas, and the new ones on the host's free devices (`PoolSignals.startable`).
"""

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from workers.fleet.signals import PoolSignals, ReplicaSignals


@dataclass
class AutoscalerConfig:
    """One pool's policy. Defaults suit a pool of small-model workers."""

    min_replicas: int = 1  # the warm pool: never fewer, even idle
    max_replicas: int = 8
    target_running_per_replica: float = 8.0  # sequences one replica should carry
    target_kv_fraction: float = 0.9  # of a replica's KV tokens
    backlog_drain_s: float = 300.0  # extra capacity to clear queued work within this
    # Demand within this fraction of a replica over a whole count rounds down: the
    # headroom under `target_running_per_replica` absorbs it, and arrival noise does not
    # ratchet the pool up (the long window would keep each excursion).
    up_tolerance: float = 0.25
    scale_up_window_s: float = 5.0  # scale up to the lowest recommendation of this window
    scale_down_window_s: float = 120.0  # scale down to the highest of this window
    ttft_slo_s: float = 2.0  # TTFT p90 or estimated wait above it: never scale down

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self}")
        if self.target_running_per_replica <= 0 or not 0 < self.target_kv_fraction <= 1:
            raise ValueError(f"targets must be positive (kv fraction <= 1), got {self}")


@dataclass(frozen=True, slots=True)
class Recommendation:
    """What this tick's signals alone ask for, before the windows."""

    num_replicas: int
    demand_slots: float  # concurrent sequences the demand needs (nan: unknown)
    complete: bool  # every signal the formula uses was present
    reason: str


@dataclass(frozen=True, slots=True)
class Decision:
    """One tick's verdict for one pool; what `GET /admin/fleet` shows as the last one."""

    pool: str
    at_s: float  # the clock reading it was made at
    num_ordered: int  # ready + starting when it was made
    recommendation: int  # this tick's raw recommendation
    desired_replicas: int  # after the windows and bounds
    num_start: int  # replicas to order now
    drain: tuple[str, ...]  # replica ids to drain now (a starting one is cancelled)
    demand_slots: float
    reason: str

    @property
    def is_noop(self) -> bool:
        return self.num_start == 0 and not self.drain

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["drain"] = list(self.drain)
        if math.isnan(self.demand_slots):
            out["demand_slots"] = None
        return out


def recommend(signals: PoolSignals, config: AutoscalerConfig) -> Recommendation:
    """The replica count this instant's signals need (bounded), and why."""
    active = signals.in_state("ready", "draining", "stalled")
    complete = (
        signals.queue_depth is not None
        and signals.arrivals_per_s is not None
        and signals.mean_service_s is not None
        and all(r.has_metrics for r in active)
    )
    running = sum(r.num_running or 0 for r in active)
    backlog = (signals.queue_depth or 0) + sum(r.num_waiting or 0 for r in active)
    service_s = signals.mean_service_s
    if service_s is not None and signals.arrivals_per_s is not None:
        flow = signals.arrivals_per_s * service_s
        # The flow, not `running`: running also counts the backlog being worked off.
        demand = flow + backlog * service_s / config.backlog_drain_s
        why = f"demand {demand:.1f} slots (flow {flow:.1f}, running {running}, backlog {backlog})"
    elif service_s is not None:
        demand = running + backlog * service_s / config.backlog_drain_s
        why = f"demand {demand:.1f} slots (no arrival rate; running {running}, backlog {backlog})"
    else:
        # No completions yet to time a request: every waiting request is one slot.
        demand = float(running + backlog)
        why = f"demand {demand:.0f} slots (no service time; running {running}, backlog {backlog})"
    by_demand = math.ceil(demand / config.target_running_per_replica - config.up_tolerance)
    kv_used = sum(r.kv_used_tokens or 0 for r in active)
    kv_per_replica = max((r.kv_total_tokens or 0 for r in signals.replicas), default=0)
    by_kv = (
        math.ceil(kv_used / (config.target_kv_fraction * kv_per_replica) - 1e-9)
        if kv_per_replica
        else 0
    )
    if by_kv > by_demand:
        why += f"; KV {kv_used} tokens needs {by_kv}"
    num = min(max(by_demand, by_kv, config.min_replicas), config.max_replicas)
    return Recommendation(num, demand, complete, why)


def choose_victims(replicas: list[ReplicaSignals], count: int) -> list[str]:
    """The `count` replicas to drain: starting ones first (newest first: furthest from
    ready, nothing resident), then ready ones with the fewest resident tokens."""
    starting = sorted((r for r in replicas if r.state == "starting"), key=lambda r: -r.ordered_at_s)
    ready = sorted(
        (r for r in replicas if r.state == "ready"),
        key=lambda r: (
            r.kv_used_tokens if r.kv_used_tokens is not None else math.inf,
            r.num_running if r.num_running is not None else math.inf,
            r.replica_id,
        ),
    )
    return [r.replica_id for r in (starting + ready)[: max(count, 0)]]


def plan_change(
    signals: PoolSignals,
    desired: int,
    now_s: float,
    recommendation: int,
    reason: str,
    demand_slots: float = math.nan,
) -> Decision:
    """The decision that moves the pool from its ordered count to `desired`."""
    ordered = signals.num_ordered
    drain = choose_victims(signals.replicas, ordered - desired) if desired < ordered else []
    return Decision(
        pool=signals.pool,
        at_s=now_s,
        num_ordered=ordered,
        recommendation=recommendation,
        desired_replicas=desired,
        num_start=max(desired - ordered, 0),
        drain=tuple(drain),
        demand_slots=demand_slots,
        reason=reason,
    )


@dataclass
class _History:
    samples: deque[tuple[float, int]] = field(default_factory=deque)  # (at_s, replicas)


class Autoscaler:
    """Stateful only in its windows of past recommendations, one per pool.

    Call `decide` once per tick per pool (every second or so) with fresh signals and
    the clock; hand the result to an `Actuator`. The same inputs give the same output.
    """

    def __init__(self, configs: dict[str, AutoscalerConfig]) -> None:
        self.configs = configs
        self._history: dict[str, _History] = {}
        self.last: dict[str, Decision] = {}  # per pool, for GET /admin/fleet

    def decide(self, signals: PoolSignals, now_s: float) -> Decision:
        config = self.configs[signals.pool]
        rec = recommend(signals, config)
        ordered = signals.num_ordered
        hold_reason = _hold_down_reason(signals, rec, config)
        # A held tick must not let the long window forget the capacity in place.
        stored = max(rec.num_replicas, ordered) if hold_reason else rec.num_replicas
        history = self._history.setdefault(signals.pool, _History()).samples
        history.append((now_s, stored))
        horizon = max(config.scale_up_window_s, config.scale_down_window_s)
        while history and history[0][0] < now_s - horizon:
            history.popleft()
        up_to = min(n for t, n in history if t >= now_s - config.scale_up_window_s)
        down_to = max(n for t, n in history if t >= now_s - config.scale_down_window_s)
        if up_to > ordered:
            desired, why = up_to, f"scale up: {rec.reason}"
        elif down_to < ordered and not hold_reason:
            desired = down_to
            why = f"scale down: highest over {config.scale_down_window_s:.0f} s is {down_to}"
        else:
            desired = ordered
            why = f"hold: {hold_reason or rec.reason}"
        desired = min(max(desired, config.min_replicas), config.max_replicas)
        desired, why = _bound_starts(signals, config, desired, why)
        decision = plan_change(signals, desired, now_s, rec.num_replicas, why, rec.demand_slots)
        self.last[signals.pool] = decision
        return decision


def _bound_starts(
    signals: PoolSignals, config: AutoscalerConfig, desired: int, why: str
) -> tuple[int, str]:
    """`desired`, lowered so that what it starts fits: every process of the pool (draining
    ones too) within max_replicas, and the new ones on the host's free devices."""
    ordered = signals.num_ordered
    if desired <= ordered:
        return desired, why
    room = config.max_replicas - len(signals.replicas)
    bounds = [(room, f"max_replicas {config.max_replicas} counting every replica")]
    if signals.startable is not None:
        bounds.append((signals.startable, f"devices free for {signals.startable} more"))
    limit, reason = min(bounds, key=lambda b: b[0])
    if desired - ordered <= limit:
        return desired, why
    bounded = ordered + max(limit, 0)
    return bounded, f"{why}; {desired} wanted, {bounded} bounded by {reason}"


def _hold_down_reason(
    signals: PoolSignals, rec: Recommendation, config: AutoscalerConfig
) -> str | None:
    """Why this tick may not scale down (None: it may)."""
    if not rec.complete:
        return "metrics missing, never scale down on them"
    for name, value in (("TTFT p90", signals.ttft_p90_s), ("wait", signals.estimated_wait_s)):
        if value is not None and value > config.ttft_slo_s:
            return f"{name} {value:.2f} s over the {config.ttft_slo_s:.2f} s SLO"
    return None
