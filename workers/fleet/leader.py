"""One autoscaler for a fleet of hosts: the lease loop, the leader's tick, a host's orders.

Every host's supervisor (`switchyard serve --join`) runs all three:
- `LeaseKeeper`: contends for the leader lease and renews it while held
  (`workers.fleet.lease` has the policy, `workers.fleet.coordination` the Redis scripts).
- `HostAgent`: once a tick, takes the orders addressed to this host, carries out those of
  the newest leader on its `Actuator` (the local supervisor) and refuses the others, then
  writes the host's record (devices, replicas, demand, the last order seq it took).
- `FleetLeader`: while this host holds the lease, once a tick reads every host's record,
  the pools' members and the plain gateways' demand reports, decides per pool with the
  `Autoscaler` on the fleet-wide signals (`workers.fleet.placement`: members no host runs
  count as replicas), places new replicas on hosts with free devices, and writes the
  orders with its fencing token and the desired counts it publishes.

A new leader decides only from records written after it took the lease: by then every
host has taken (or, token stale, refused) every order of the leader before it, and its
record shows what they did, so no decision is carried out twice across a change of leader.
"""

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from workers.api.demand import GatewayDemand
from workers.api.demand_store import DemandStore
from workers.api.membership import PoolMembers
from workers.api.membership_store import MembershipStore
from workers.fleet.actuator import Actuator
from workers.fleet.autoscaler import Autoscaler, AutoscalerConfig, Decision
from workers.fleet.coordination import FleetStore
from workers.fleet.devices import NoDevices
from workers.fleet.hosts import HostRecord, Order, TakenOrder
from workers.fleet.lease import LeaseHolder
from workers.fleet.placement import (
    PendingOrders,
    fleet_signals,
    hold_drains,
    plan_orders,
)
from workers.fleet.signals import PoolSignals

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Runs one `LeaseHolder` against the store: acquires when due, renews while held.
    Each call is bounded by the renew interval, so a hung Redis cannot keep a stale
    holder believing it leads (its validity is on its own clock anyway)."""

    def __init__(
        self, store: FleetStore, holder: LeaseHolder, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.store = store
        self.holder = holder
        self.clock = clock
        self.acquired_server_ms = 0  # the Redis server's clock when this tenure began

    async def step(self) -> None:
        holder = self.holder
        sent = self.clock()
        action = holder.due(sent)
        if action is None:
            return
        limit_s = holder.config.renew_every_s
        try:
            if action == "acquire":
                got = await asyncio.wait_for(
                    self.store.acquire(holder.holder_id, holder.config.ttl_ms), limit_s
                )
                if got.token is None:
                    holder.refused(sent, got.remaining_ms / 1000)
                    return
                holder.acquired(got.token, sent)
                self.acquired_server_ms = got.server_ms
                log.info("%s leads the fleet (token %d)", holder.holder_id, got.token)
                return
            assert holder.token is not None
            renewed = await asyncio.wait_for(
                self.store.renew(holder.holder_id, holder.token, holder.config.ttl_ms), limit_s
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis unreachable or slow: try again soon
            log.warning("fleet lease: %s failed (%r)", action, exc)
            holder.failed(sent)
            return
        if renewed:
            holder.renewed(sent)
        else:
            log.warning("%s lost the fleet lease (token %s)", holder.holder_id, holder.token)
            holder.renewal_refused()

    async def run(self) -> None:
        while True:
            await self.step()
            wait_s = self.holder.next_attempt_s - self.clock()
            await asyncio.sleep(min(max(wait_s, 0.01), self.holder.config.renew_every_s))

    async def release(self) -> None:
        """Give the lease up now (a clean exit): a contender takes it at its next try."""
        token = self.holder.token
        self.holder.released()
        if token is not None:
            await self.store.release(self.holder.holder_id, token)


class HostAgent:
    """A host's side of the fleet: its orders in, its record out."""

    def __init__(self, store: FleetStore, host_id: str, actuator: Actuator) -> None:
        self.store = store
        self.host_id = host_id
        self.actuator = actuator
        self.highest_token = 0  # the newest leader's token this host has obeyed
        self.last_order_seq = 0
        self.num_applied = 0
        self.num_refused = 0
        self.last_taken_ms = 0

    async def take_orders(self) -> list[TakenOrder]:
        """Take this host's orders and carry out the newest leader's; the ones done."""
        taken = await self.store.take_orders(self.host_id)
        for order in taken.refused:
            self._refuse(order, "its leader has been replaced")
        done = []
        for order in taken.accepted:
            if order.token < self.highest_token:  # one already obeyed is newer
                self._refuse(order, f"token below {self.highest_token}")
                continue
            self.highest_token = order.token
            self.last_order_seq = max(self.last_order_seq, order.seq)
            self._carry_out(order.order)
            self.num_applied += 1
            done.append(order)
        if taken.unreadable:
            log.warning("fleet: %d unreadable orders dropped", taken.unreadable)
        return done

    def _refuse(self, taken: TakenOrder, why: str) -> None:
        self.last_order_seq = max(self.last_order_seq, taken.seq)
        self.num_refused += 1
        log.warning(
            "fleet: refused order %d (token %d) for %s: %s",
            taken.seq,
            taken.token,
            taken.order.pool,
            why,
        )

    def _carry_out(self, order: Order) -> None:
        log.info(
            "fleet order for %s: start %d, drain %s (%s)",
            order.pool,
            order.num_start,
            order.drain or "none",
            order.reason,
        )
        for replica_id in order.drain:
            self.actuator.drain_replica(order.pool, replica_id)
        for _ in range(order.num_start):
            try:
                self.actuator.start_replica(order.pool)
            except (NoDevices, KeyError) as exc:  # another pool took them; or not ours
                log.warning("fleet order for %s not carried out: %r", order.pool, exc)
                break

    async def write_record(self, record: HostRecord, ttl_ms: int) -> None:
        """Write this host's record, stamped with the last order seq it took."""
        stamped = msgspec.structs.replace(
            record, host_id=self.host_id, last_order_seq=self.last_order_seq
        )
        await self.store.write_host(stamped, ttl_ms)


class FleetLeader:
    """The leader's tick. `configs`: each pool's policy (fleet-wide bounds)."""

    def __init__(
        self,
        store: FleetStore,
        keeper: LeaseKeeper,
        configs: dict[str, AutoscalerConfig],
        clock: Callable[[], float] = time.monotonic,
        members: MembershipStore | None = None,
        demand: DemandStore | None = None,
    ) -> None:
        self.store = store
        self.keeper = keeper
        self.configs = configs
        self.clock = clock
        # The pools' members (those no host runs count as replicas) and the plain
        # gateways' demand reports; None: host records only.
        self.members = members
        self.demand = demand
        self.last_members: dict[str, PoolMembers] = {}
        self.last_demand: list[GatewayDemand] = []
        self.autoscaler = Autoscaler(configs)
        self.pending = PendingOrders()
        self.tenure_token: int | None = None
        self.last_signals: dict[str, PoolSignals] = {}
        self.hosts: list[HostRecord] = []
        self.num_orders = 0  # orders written (all tenures)
        self.num_refused = 0  # orders Redis refused: this leader had been replaced
        self.waiting_for: list[str] = []  # hosts whose record predates this tenure

    async def step(self) -> list[Order]:
        """One tick: the orders written (empty when not leader or nothing to do)."""
        holder = self.keeper.holder
        now = self.clock()
        token = holder.token if holder.is_leader(now) else None
        if token is None:
            self.tenure_token = None
            return []
        if token != self.tenure_token:  # a new tenure: nothing of an earlier one holds
            self.tenure_token = token
            self.autoscaler = Autoscaler(self.configs)
            self.pending = PendingOrders()
        hosts, _, _ = await self.store.read_hosts()
        self.hosts = hosts
        self.waiting_for = [
            h.host_id for h in hosts if h.written_at_ms <= self.keeper.acquired_server_ms
        ]
        if self.waiting_for:
            return []
        self.pending.settle(hosts)
        pools = list(self.configs)
        self.last_members = await self.members.read(pools) if self.members else {}
        self.last_demand = await self.demand.read() if self.demand else []
        decisions = [self._decide(pool, hosts, now, holder.tenure_s(now)) for pool in pools]
        orders = [
            o for d in decisions if d is not None for o in plan_orders(d, hosts, self.pending)
        ]
        if not holder.is_leader(self.clock()):
            return []  # the lease ran out while reading: decide nothing on its authority
        seqs = await self.store.give_orders(token, orders)
        if seqs is None:
            self.num_refused += len(orders)
            log.warning("fleet: orders of token %d refused: a newer leader exists", token)
            holder.renewal_refused()
            return []
        for seq, order in zip(seqs, orders, strict=True):
            self.pending.add(seq, order)
        self.num_orders += len(orders)
        desired = {d.pool: d.desired_replicas for d in decisions if d is not None}
        await self.store.publish_desired(token, desired)
        return orders

    def _decide(
        self, pool: str, hosts: list[HostRecord], now: float, tenure_s: float
    ) -> Decision | None:
        if not any(pool in h.pools for h in hosts):
            return None  # no host runs it (yet)
        signals = fleet_signals(
            pool, hosts, self.pending, now, self.last_members.get(pool), self.last_demand
        )
        self.last_signals[pool] = signals
        decision = self.autoscaler.decide(signals, now)
        if tenure_s < self.configs[pool].scale_down_window_s:
            decision = hold_drains(decision, signals)
            self.autoscaler.last[pool] = decision
        if not decision.is_noop:
            log.info(
                "fleet autoscaler %s: %d -> %d (%s)",
                pool,
                decision.num_ordered,
                decision.desired_replicas,
                decision.reason,
            )
        return decision
