"""A discrete-time simulation of one pool: traces, replicas, the gateway queue.

Requests arrive per a trace (requests per second over time, Poisson), each holds one of
a replica's `capacity_per_replica` slots for its service time. The gateway queues what
finds no free slot, FIFO, up to `queue_capacity`; past that it refuses. TTFT is the
queue wait plus `prefill_s`. A replica is ready `startup_s` after it is ordered. A
drained replica finishes its in-flight requests before it exits, or, with a
`drain_grace_s`, hands what is left after the grace to the other replicas (the workers'
migrating drain: the gateway resumes each stream elsewhere, `resume_s` of prefill for
the prompt and the tokens already sent) and exits then. Time is a number:
the policy gets the simulated clock, nothing sleeps, and a seed fixes every run.

`SimPool` is an `Actuator`: the policy's decisions reach the simulated replicas through
the same `apply_decision` the supervisor uses.
"""

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.fleet.actuator import apply_decision
from workers.fleet.autoscaler import Decision
from workers.fleet.signals import PoolSignals, ReplicaSignals, ReplicaState

Policy = Callable[[PoolSignals, float], Decision]


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    rate_per_s: Callable[[float], float]  # offered requests per second at time t


@dataclass
class SimConfig:
    capacity_per_replica: int = 8  # concurrent requests (sequences) per replica
    target_utilization: float = 0.85  # of those slots: what "needed" plans for
    startup_s: float = 30.0  # ordered -> ready
    mean_service_s: float = 4.0  # a request holds a slot U(0.5, 1.5) x this
    prefill_s: float = 0.2  # added to the queue wait to make TTFT
    queue_capacity: int = 1000  # gateway queue bound, requests
    ttft_slo_s: float = 2.0
    min_replicas: int = 2
    max_replicas: int = 16
    dt_s: float = 0.1  # simulation step
    decide_every_s: float = 1.0  # policy tick
    rate_window_s: float = 10.0  # arrivals per second are counted over this
    max_tail_s: float = 900.0  # after the trace, run on until every request is served
    kv_tokens_per_request: tuple[int, int] = (200, 1000)  # resident tokens, uniform
    # Long answers: this share of requests holds a slot U(0.5, 1.5) x `long_service_s`
    # (2,000 tokens at 45 ms a token is 90 s).
    long_share: float = 0.0
    long_service_s: float = 90.0
    # None: a drained replica waits for its longest stream. A number: it hands the streams
    # it still holds over after this long (the worker's `drain_grace_s`).
    drain_grace_s: float | None = None
    resume_s: float = 0.15  # a handed-over stream's stall: prefill of prompt + sent tokens
    seed: int = 0

    @property
    def mean_request_s(self) -> float:
        """The mean time a request holds a slot, long answers included."""
        return (1 - self.long_share) * self.mean_service_s + self.long_share * self.long_service_s

    def needed(self, rate_per_s: float) -> int:
        """Replicas the offered rate needs at the per-replica capacity target, within the
        bounds (at 100 % of the slots a queue never drains)."""
        per_replica = self.capacity_per_replica * self.target_utilization
        raw = math.ceil(rate_per_s * self.mean_request_s / per_replica - 1e-9)
        return min(max(raw, self.min_replicas), self.max_replicas)


@dataclass
class SimResult:
    offered: int = 0
    served: int = 0
    refused: int = 0
    refused_below_max: int = 0  # refused while the policy could still have ordered more
    stream_cuts: int = 0  # requests still resident when their replica exited
    handed_over: int = 0  # streams a drained replica handed to another after its grace
    resume_stall_s: list[float] = field(default_factory=list)  # each hand-over's stall
    drain_s: list[float] = field(default_factory=list)  # each drain, ordered -> exited
    replica_seconds: float = 0.0  # starting + ready + draining, over the trace
    peak_ordered: int = 0  # most replicas ordered (ready + starting) at once
    peak_needed: int = 0
    time_to_capacity_s: float = 0.0  # longest stretch with ready < needed
    flaps: int = 0  # direction reversals within `flap_window_s` of the previous change
    ttft_s: list[float] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)  # the ones that changed something


@dataclass
class _Replica:
    replica_id: str
    state: ReplicaState
    ordered_at_s: float
    ready_at_s: float
    inflight: list[tuple[float, int, float]] = field(default_factory=list)  # heap: end_s,
    # tokens, service_s
    resident_tokens: int = 0
    draining_since_s: float = 0.0  # set when it is told to drain


class SimPool:
    """The simulated replicas of one pool; implements `Actuator`."""

    def __init__(self, name: str, config: SimConfig) -> None:
        self.name = name
        self.config = config
        self.now_s = 0.0
        self.replicas: dict[str, _Replica] = {}
        self._next_id = 0

    def start_replica(self, pool: str) -> str:
        replica_id = f"{pool}-{self._next_id}"
        self._next_id += 1
        ready_at = self.now_s + self.config.startup_s
        self.replicas[replica_id] = _Replica(replica_id, "starting", self.now_s, ready_at)
        return replica_id

    def drain_replica(self, pool: str, replica_id: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None:
            return
        if replica.state == "starting":
            del self.replicas[replica_id]
        elif replica.state != "draining":
            replica.state = "draining"
            replica.draining_since_s = self.now_s

    def count(self, *states: ReplicaState) -> int:
        return sum(1 for r in self.replicas.values() if r.state in states)


def make_arrivals(trace: Trace, config: SimConfig) -> list[tuple[float, float, int]]:
    """(arrival_s, service_s, resident_tokens) per request; the same for every policy."""
    rng = random.Random(config.seed)
    out: list[tuple[float, float, int]] = []
    lo, hi = config.kv_tokens_per_request
    for k in range(round(trace.duration_s / config.dt_s)):
        t = k * config.dt_s
        for _ in range(_poisson(rng, trace.rate_per_s(t) * config.dt_s)):
            service = config.mean_service_s * rng.uniform(0.5, 1.5)
            # Drawn only when asked for, so traces without long answers keep their arrivals.
            if config.long_share and rng.random() < config.long_share:
                service = config.long_service_s * rng.uniform(0.5, 1.5)
            out.append((t + rng.random() * config.dt_s, service, rng.randint(lo, hi)))
    return out


def _poisson(rng: random.Random, lam: float) -> int:
    limit, n, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        n += 1
        p *= rng.random()
    return n


def simulate(
    policy: Policy,
    trace: Trace,
    config: SimConfig,
    arrivals: list[tuple[float, float, int]] | None = None,
    flap_window_s: float = 120.0,
) -> SimResult:
    """Replay `trace` against `policy`; every offered request ends served or refused."""
    arrivals = make_arrivals(trace, config) if arrivals is None else arrivals
    pool = SimPool(trace.name, config)
    res = SimResult(offered=len(arrivals))
    for _ in range(config.needed(trace.rate_per_s(0.0))):
        pool.replicas[pool.start_replica(trace.name)].state = "ready"
    queue: deque[tuple[float, float, int]] = deque()
    handed: deque[tuple[float, float, int, float]] = deque()  # (at_s, left_s, tokens, service_s)
    offered_at: deque[float] = deque()
    completed: deque[tuple[float, float]] = deque()  # (end_s, service_s)
    dispatched: deque[tuple[float, float]] = deque()  # (at_s, ttft_s)
    changes: list[tuple[float, int]] = []  # (at_s, +1 / -1)
    short_since: float | None = None
    dt, cap = config.dt_s, config.capacity_per_replica
    every = max(round(config.decide_every_s / dt), 1)
    i, k = 0, 0

    def free_replica() -> _Replica | None:
        ready = [r for r in pool.replicas.values() if r.state == "ready"]
        target = min(ready, key=lambda r: len(r.inflight), default=None)
        return None if target is None or len(target.inflight) >= cap else target

    def resume(stream: tuple[float, float, int, float], at_s: float) -> bool:
        """A handed-over stream goes on elsewhere, ahead of queued requests."""
        target = free_replica()
        if target is None:
            return False
        handed_at, left_s, tokens, service_s = stream
        heapq.heappush(target.inflight, (at_s + config.resume_s + left_s, tokens, service_s))
        target.resident_tokens += tokens
        res.resume_stall_s.append(at_s - handed_at + config.resume_s)
        return True

    def dispatch(req: tuple[float, float, int], at_s: float) -> bool:
        target = free_replica()
        if target is None:
            return False
        heapq.heappush(target.inflight, (at_s + req[1], req[2], req[1]))
        target.resident_tokens += req[2]
        ttft = at_s - req[0] + config.prefill_s
        res.ttft_s.append(ttft)
        dispatched.append((at_s, ttft))
        return True

    while True:
        t = k * dt
        pool.now_s = t
        in_trace = t < trace.duration_s
        for r in list(pool.replicas.values()):
            while r.inflight and r.inflight[0][0] <= t:
                end, tokens, service = heapq.heappop(r.inflight)
                r.resident_tokens -= tokens
                completed.append((end, service))
                res.served += 1
            if r.state == "starting" and r.ready_at_s <= t:
                r.state = "ready"
            if r.state == "draining" and r.inflight and _grace_over(r, t, config):
                for end, tokens, service in r.inflight:
                    handed.append((t, end - t, tokens, service))
                res.handed_over += len(r.inflight)
                r.inflight, r.resident_tokens = [], 0
            if r.state == "draining" and not r.inflight:
                del pool.replicas[r.replica_id]  # drained: it exits
                res.drain_s.append(t - r.draining_since_s)
        while handed and resume(handed[0], t):
            handed.popleft()
        while queue and dispatch(queue[0], t):
            queue.popleft()
        while i < len(arrivals) and arrivals[i][0] < t + dt:
            req = arrivals[i]
            i += 1
            offered_at.append(req[0])
            if queue or not dispatch(req, req[0]):
                if len(queue) < config.queue_capacity:
                    queue.append(req)
                else:
                    res.refused += 1
                    if pool.count("ready", "starting") < config.max_replicas:
                        res.refused_below_max += 1
        if k % every == 0:
            signals = _signals(pool, t, queue, offered_at, completed, dispatched, config)
            decision = policy(signals, t)
            before = pool.count("ready", "starting")
            apply_decision(decision, pool)
            after = pool.count("ready", "starting")
            if after != before:
                res.decisions.append(decision)
                changes.append((t, 1 if after > before else -1))
        if in_trace:
            res.replica_seconds += len(pool.replicas) * dt
            res.peak_ordered = max(res.peak_ordered, pool.count("ready", "starting"))
            need = config.needed(trace.rate_per_s(t))
            res.peak_needed = max(res.peak_needed, need)
            if pool.count("ready") < need:
                short_since = t if short_since is None else short_since
            elif short_since is not None:
                res.time_to_capacity_s = max(res.time_to_capacity_s, t - short_since)
                short_since = None
        else:
            idle = not queue and not handed and not any(r.inflight for r in pool.replicas.values())
            if (idle and i == len(arrivals)) or t > trace.duration_s + config.max_tail_s:
                break
        k += 1
    # Whatever is still resident when the run ends would be cut off by a hard stop.
    res.stream_cuts = sum(len(r.inflight) for r in pool.replicas.values()) + len(handed)
    if short_since is not None:
        res.time_to_capacity_s = max(res.time_to_capacity_s, trace.duration_s - short_since)
    res.flaps = sum(
        1
        for (t0, d0), (t1, d1) in zip(changes, changes[1:], strict=False)
        if d0 != d1 and t1 - t0 < flap_window_s
    )
    return res


def _grace_over(replica: _Replica, now_s: float, config: SimConfig) -> bool:
    grace = config.drain_grace_s
    return grace is not None and now_s - replica.draining_since_s >= grace


def _signals(
    pool: SimPool,
    now_s: float,
    queue: deque[tuple[float, float, int]],
    offered_at: deque[float],
    completed: deque[tuple[float, float]],
    dispatched: deque[tuple[float, float]],
    config: SimConfig,
) -> PoolSignals:
    """What the gateway and the workers' /load would report at `now_s`."""
    while offered_at and offered_at[0] < now_s - config.rate_window_s:
        offered_at.popleft()
    while completed and completed[0][0] < now_s - 60.0:
        completed.popleft()
    while dispatched and dispatched[0][0] < now_s - 10.0:
        dispatched.popleft()
    recent_done = sum(1 for end, _ in completed if end >= now_s - 10.0)
    if not queue:
        wait_s = 0.0
    else:
        wait_s = len(queue) / (recent_done / 10.0) if recent_done else math.inf
    ttfts = sorted(x for _, x in dispatched)
    kv_total = config.capacity_per_replica * config.kv_tokens_per_request[1]
    replicas = tuple(
        ReplicaSignals(
            replica_id=r.replica_id,
            state=r.state,
            ordered_at_s=r.ordered_at_s,
            num_running=None if r.state == "starting" else len(r.inflight),
            num_waiting=None if r.state == "starting" else 0,
            kv_used_tokens=None if r.state == "starting" else r.resident_tokens,
            kv_total_tokens=kv_total,
        )
        for r in pool.replicas.values()
    )
    return PoolSignals(
        pool=pool.name,
        replicas=replicas,
        queue_depth=len(queue),
        estimated_wait_s=wait_s,
        # Not a full window of history yet: unknown, not zero.
        arrivals_per_s=len(offered_at) / config.rate_window_s
        if now_s >= config.rate_window_s
        else None,
        mean_service_s=sum(s for _, s in completed) / len(completed) if completed else None,
        ttft_p90_s=ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
    )
