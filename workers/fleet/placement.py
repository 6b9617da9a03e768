"""The leader's fleet-wide view and where new replicas go: pure functions of host records.

`fleet_signals` merges every host's record of a pool into one `PoolSignals` (replicas of
every host, demand summed over every host's gateway, devices free anywhere), with the
leader's orders still in flight counted as replicas starting (or draining), so the
`Autoscaler` decides once for the whole fleet and a decision is never made twice while
its order travels. `plan_orders` turns its `Decision` into one `Order` per host: drains to
the hosts that run the victims, starts placed by `place_starts` on hosts with free devices.

A fleet-wide replica id is `<host id>/<the host's replica id>`.

Members no supervisor of the fleet runs (`switchyard worker --join`, Kubernetes worker
pods) are replicas too: every live member of the pool's membership whose announcer is no
host's (`HostRecord.announcer`) counts, as `member/<member id>`, toward the pool's replicas
and so toward max_replicas; its load is what the gateways last saw on its /load. The leader
cannot start or drain them (whatever runs them scales on the desired count it publishes),
so its orders never name them, and a pool that has any is not bounded by the hosts' free
devices: its desired count may exceed what the hosts can place, the rest being for that
outside actuator. Plain gateways' demand reports (`workers.api.demand`) add to the hosts'.
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from workers.api.demand import GatewayDemand, MemberLoad
from workers.api.membership import MemberRecord, PoolMembers
from workers.fleet.autoscaler import Decision, plan_change
from workers.fleet.hosts import HostRecord, Order, PoolRecord
from workers.fleet.signals import PoolSignals, ReplicaSignals, ReplicaState

PENDING = "pending"  # the host part of an id standing for a start still in flight
MEMBER = "member"  # the host part of the id of a member no supervisor of the fleet runs
_MEMBER_STATES: dict[str, ReplicaState] = {
    "starting": "starting",
    "ready": "ready",
    "draining": "draining",
}


def fleet_id(host_id: str, replica_id: str) -> str:
    return f"{host_id}/{replica_id}"


def split_id(replica_id: str) -> tuple[str, str]:
    host, _, local = replica_id.partition("/")
    return host, local


@dataclass(frozen=True, slots=True)
class SentOrder:
    seq: int
    order: Order


@dataclass
class PendingOrders:
    """The leader's orders not yet reflected in their host's record (a record shows an
    order once its `last_order_seq` reaches the order's seq)."""

    orders: list[SentOrder] = field(default_factory=list)

    def add(self, seq: int, order: Order) -> None:
        self.orders.append(SentOrder(seq, order))

    def settle(self, hosts: Iterable[HostRecord]) -> None:
        """Drop orders their host has taken, and orders to hosts gone from the fleet."""
        seen = {h.host_id: h.last_order_seq for h in hosts}
        self.orders = [
            o for o in self.orders if o.order.host_id in seen and o.seq > seen[o.order.host_id]
        ]

    def for_pool(self, pool: str) -> list[SentOrder]:
        return [o for o in self.orders if o.order.pool == pool]


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


class Demand(Protocol):
    """What a host record and a gateway's report both say of a pool's demand."""

    @property
    def queue_depth(self) -> int | None: ...
    @property
    def estimated_wait_s(self) -> float | None: ...
    @property
    def arrivals_per_s(self) -> float | None: ...
    @property
    def mean_service_s(self) -> float | None: ...
    @property
    def ttft_p90_s(self) -> float | None: ...


def unsupervised_members(
    members: PoolMembers | None, hosts: list[HostRecord]
) -> list[MemberRecord]:
    """The pool's live members that no host in `hosts` runs: not withdrawn, not announced
    by a host's announcer, and of the pool's model (a refused member is no replica)."""
    if members is None:
        return []
    announcers = {h.announcer for h in hosts if h.announcer}
    out = []
    for live in members.members:
        record = live.record
        if record.state not in _MEMBER_STATES or record.announcer in announcers:
            continue
        if members.fingerprint is not None and record.fingerprint != members.fingerprint:
            continue
        out.append(record)
    return out


def merged_loads(
    pool: str, hosts: list[HostRecord], demand: Sequence[GatewayDemand]
) -> dict[str, MemberLoad]:
    """Per member URL, the busiest load any gateway (a host's or a plain one) reports: a
    report with numbers over one without, then the most running, then the most KV used
    (reports differ only by when each gateway polled)."""
    reports = [h.pools[pool].members for h in hosts if pool in h.pools]
    reports += [g.pools[pool].members for g in demand if pool in g.pools]
    best: dict[str, MemberLoad] = {}
    for report in reports:
        for url, load in report.items():
            have = best.get(url)
            if have is None or _busier(load, have):
                best[url] = load
    return best


def _busier(a: MemberLoad, b: MemberLoad) -> bool:
    def key(x: MemberLoad) -> tuple[bool, int, int]:
        return (x.num_running is not None, x.num_running or 0, x.kv_used_tokens or 0)

    return key(a) > key(b)


def member_replicas(
    records: list[MemberRecord], loads: dict[str, MemberLoad], now_s: float
) -> list[ReplicaSignals]:
    out = []
    for record in records:
        load = loads.get(record.url)
        measured = load is not None and load.num_running is not None
        out.append(
            ReplicaSignals(
                replica_id=fleet_id(MEMBER, record.member_id),
                state=_MEMBER_STATES[record.state],
                ordered_at_s=now_s,
                num_running=load.num_running if measured and load else None,
                num_waiting=load.num_waiting if measured and load else None,
                kv_used_tokens=(load.kv_used_tokens or 0) if measured and load else None,
                kv_total_tokens=load.kv_total_tokens if load else None,
            )
        )
    return out


def fleet_signals(
    pool: str,
    hosts: list[HostRecord],
    pending: PendingOrders,
    now_s: float,
    members: PoolMembers | None = None,
    demand: Sequence[GatewayDemand] = (),
) -> PoolSignals:
    """The pool across every host in `hosts`, with `pending` orders applied, the live
    `members` no host runs counted as replicas, and the plain gateways' `demand` added."""
    parts = [(h.host_id, h.pools[pool]) for h in hosts if pool in h.pools]
    in_flight = pending.for_pool(pool)
    draining = {fleet_id(o.order.host_id, r) for o in in_flight for r in o.order.drain}
    replicas: list[ReplicaSignals] = []
    for host_id, part in parts:
        for r in part.replicas:
            rid = fleet_id(host_id, r.replica_id)
            replicas.append(
                ReplicaSignals(
                    replica_id=rid,
                    state="draining" if rid in draining and r.state != "draining" else r.state,
                    ordered_at_s=now_s - r.age_s,
                    num_running=r.num_running,
                    num_waiting=r.num_waiting,
                    kv_used_tokens=r.kv_used_tokens,
                    kv_total_tokens=r.kv_total_tokens,
                )
            )
    for sent in in_flight:
        for i in range(sent.order.num_start):
            rid = fleet_id(PENDING, f"{sent.order.host_id}-{sent.seq}-{i}")
            replicas.append(ReplicaSignals(replica_id=rid, state="starting", ordered_at_s=now_s))
    outside = unsupervised_members(members, hosts)
    replicas += member_replicas(outside, merged_loads(pool, hosts, demand), now_s)
    sources: list[Demand] = [p for _, p in parts]
    sources += [g.pools[pool] for g in demand if pool in g.pools]
    return PoolSignals(
        pool=pool,
        replicas=tuple(replicas),
        queue_depth=_int(_sum([p.queue_depth for p in sources])),
        estimated_wait_s=_max([p.estimated_wait_s for p in sources]),
        arrivals_per_s=_sum([p.arrivals_per_s for p in sources]),
        mean_service_s=_mean_service_s(sources),
        ttft_p90_s=_max([p.ttft_p90_s for p in sources]),
        # Members run by something else: that actuator, not the hosts' devices, bounds them.
        startable=None if outside else _startable(parts, in_flight),
    )


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _mean_service_s(parts: Sequence[Demand]) -> float | None:
    """Weighted by each source's arrivals (one with none yet weighs 1 in a plain mean)."""
    timed = [(p.mean_service_s, p.arrivals_per_s or 0.0) for p in parts if p.mean_service_s]
    if not timed:
        return None
    weight = sum(w for _, w in timed)
    if weight <= 0:
        return sum(s for s, _ in timed) / len(timed)
    return sum(s * w for s, w in timed) / weight


def _startable(parts: list[tuple[str, PoolRecord]], in_flight: list[SentOrder]) -> int | None:
    rooms = host_rooms(parts, in_flight)
    bounded = [r.startable for r in rooms if r.startable is not None]
    if len(bounded) < len(rooms) or not rooms:
        return None  # a host not bounded by devices: the fleet is not either
    return sum(bounded)


@dataclass(frozen=True, slots=True)
class HostRoom:
    """One host's room for one more replica of a pool."""

    host_id: str
    startable: int | None  # more replicas its free devices hold (None: not bounded)
    num_replicas: int  # the pool's replicas there, starts in flight counted


def host_rooms(parts: list[tuple[str, PoolRecord]], in_flight: list[SentOrder]) -> list[HostRoom]:
    starting: dict[str, int] = {}
    for sent in in_flight:
        starting[sent.order.host_id] = starting.get(sent.order.host_id, 0) + sent.order.num_start
    rooms = []
    for host_id, part in parts:
        extra = starting.get(host_id, 0)
        free = None if part.startable is None else max(part.startable - extra, 0)
        rooms.append(HostRoom(host_id, free, len(part.replicas) + extra))
    return rooms


def place_starts(num: int, rooms: list[HostRoom]) -> dict[str, int]:
    """Where `num` new replicas go: one at a time, each on the host with the most room left
    for it (a host not bounded by devices counts as unbounded), ties to the host with the
    fewest replicas of the pool, then by host id. Spreading keeps a pool alive when a host
    dies. Fewer than `num` are placed when room runs out; hosts with none get none."""
    room = {r.host_id: (math.inf if r.startable is None else r.startable) for r in rooms}
    count = {r.host_id: r.num_replicas for r in rooms}
    placed: dict[str, int] = {}
    for _ in range(max(num, 0)):
        open_hosts = [h for h in room if room[h] >= 1]
        if not open_hosts:
            break
        host = min(open_hosts, key=lambda h: (-room[h], count[h], h))
        room[host] -= 1
        count[host] += 1
        placed[host] = placed.get(host, 0) + 1
    return placed


def plan_orders(decision: Decision, hosts: list[HostRecord], pending: PendingOrders) -> list[Order]:
    """One order per host for `decision`: its drains to the hosts running the victims (a
    start still in flight cannot be drained yet: the next decision sees it), its starts
    placed on hosts with room."""
    drains: dict[str, list[str]] = {}
    for rid in decision.drain:
        host, local = split_id(rid)
        if host not in (PENDING, MEMBER):  # a member no host runs: its own actuator
            drains.setdefault(host, []).append(local)
    parts = [(h.host_id, h.pools[decision.pool]) for h in hosts if decision.pool in h.pools]
    starts = place_starts(decision.num_start, host_rooms(parts, pending.for_pool(decision.pool)))
    orders = []
    for host in sorted(set(drains) | set(starts)):
        orders.append(
            Order(host, decision.pool, starts.get(host, 0), drains.get(host, []), decision.reason)
        )
    return orders


def hold_drains(decision: Decision, signals: PoolSignals) -> Decision:
    """`decision` without its drains: a new leader's windows hold only its own tenure, so
    it does not scale down until it has watched a whole scale-down window."""
    if not decision.drain:
        return decision
    return plan_change(
        signals,
        max(decision.desired_replicas, signals.num_ordered),
        decision.at_s,
        decision.recommendation,
        f"hold: a new leader waits a scale-down window before draining ({decision.reason})",
        decision.demand_slots,
    )
