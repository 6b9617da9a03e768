"""The fleet loop of a `switchyard serve --join` host: one of several supervisors sharing
a Redis, one of which (the lease holder) autoscales the whole fleet.

Each tick: watch the local workers, take and carry out the orders addressed to this host
(refusing a replaced leader's), write this host's record (devices, replicas, the gateway's
demand per pool), and, while this host holds the lease, decide for every pool from every
host's record and write the orders (`workers.fleet.leader`). The lease is renewed by a task
of its own, so a slow tick never costs the lease. Without `--join` the single-host
`FleetLoop` (`cli/serve/fleet.py`) runs instead, unchanged: one host is its own leader.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from cli.serve.announce import AnnouncedMembership
from cli.serve.config import ServeConfig, autoscaler_config, lease_config
from cli.serve.fleet import RATE_WINDOW_S, FleetLoop, pool_signals
from cli.serve.fleet_metrics import export_desired_replicas
from gateway.capacity.demand import member_loads
from gateway.capacity.pool import Pool
from gateway.gateway import Gateway
from quota.connection import make_redis
from workers.api.demand_store import DemandStore
from workers.api.membership import process_identity
from workers.api.membership_store import MembershipStore
from workers.fleet.autoscaler import Autoscaler, AutoscalerConfig
from workers.fleet.coordination import FleetStore
from workers.fleet.hosts import DeviceCount, HostRecord, PoolRecord, ReplicaRecord
from workers.fleet.leader import FleetLeader, HostAgent, LeaseKeeper
from workers.fleet.lease import LeaseConfig, LeaseHolder
from workers.fleet.supervisor import LocalSupervisor

log = logging.getLogger(__name__)


def host_record(
    host_id: str,
    pools: dict[str, Pool],
    supervisor: LocalSupervisor,
    now_s: float,
    window_s: float = RATE_WINDOW_S,
    announcer: str = "",
) -> HostRecord:
    """This host now: its devices (total and free per kind) and, per pool, its replicas,
    the room its free devices have, and its gateway's demand and view of the members'
    load; `announcer`: who announces its replicas in the membership store ("" if none)."""
    records = {}
    for name, pool in pools.items():
        s = pool_signals(pool, supervisor, window_s)
        records[name] = PoolRecord(
            replicas=[ReplicaRecord.from_signals(r, now_s) for r in s.replicas],
            startable=s.startable,
            queue_depth=s.queue_depth,
            estimated_wait_s=s.estimated_wait_s,
            arrivals_per_s=s.arrivals_per_s,
            mean_service_s=s.mean_service_s,
            ttft_p90_s=s.ttft_p90_s,
            members=member_loads(pool),
        )
    devices = {}
    inventory = supervisor.inventory
    if inventory is not None:
        for kind in inventory.to_dict():
            devices[kind] = DeviceCount(inventory.total(kind), len(inventory.free(kind)))  # type: ignore[arg-type]
    return HostRecord(host_id=host_id, devices=devices, pools=records, announcer=announcer)


class JoinedFleetLoop:
    """Every `interval_s`: watch, take orders, report, and lead when leader."""

    def __init__(
        self,
        pools: dict[str, Pool],
        supervisor: LocalSupervisor,
        store: FleetStore,
        host_id: str,
        configs: dict[str, AutoscalerConfig],
        lease: LeaseConfig,
        interval_s: float = 1.0,
        rate_window_s: float = RATE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        members: MembershipStore | None = None,
        demand: DemandStore | None = None,
    ) -> None:
        self.pools = pools
        self.supervisor = supervisor
        self.store = store
        self.host_id = host_id
        self.interval_s = interval_s
        self.rate_window_s = rate_window_s
        self.clock = clock
        # Unique per process: a restarted host never renews its previous life's lease.
        holder = LeaseHolder(lease, process_identity(host_id))
        self.keeper = LeaseKeeper(store, holder, clock)
        self.agent = HostAgent(store, host_id, supervisor)
        self.leader = FleetLeader(store, self.keeper, configs, clock, members, demand)
        membership = supervisor.membership
        self.announcer = (
            membership.announcer.announcer_id if isinstance(membership, AnnouncedMembership) else ""
        )
        self.record_ttl_ms = lease.ttl_ms
        self.desired: dict[str, int] = {}  # the leader's, as last read (for /metrics)
        self.hosts: list[HostRecord] = []  # every host's record, as last read

    async def run(self) -> None:
        lease_task = asyncio.ensure_future(self.keeper.run())
        try:
            while True:
                try:
                    await self.step()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("fleet tick failed")
                await asyncio.sleep(self.interval_s)
        finally:
            lease_task.cancel()
            with contextlib.suppress(BaseException):
                await lease_task

    async def step(self) -> None:
        await self.supervisor.tick()
        if self.supervisor.stopping:
            return
        await self.agent.take_orders()
        record = host_record(
            self.host_id,
            self.pools,
            self.supervisor,
            self.clock(),
            self.rate_window_s,
            self.announcer,
        )
        await self.agent.write_record(record, self.record_ttl_ms)
        await self.leader.step()
        self.hosts = (await self.store.read_hosts())[0]
        self.desired = await self.store.read_desired()

    def fleet_ready(self, pool: str) -> int:
        """Replicas of `pool` ready on any host, as the records last read say."""
        parts = [h.pools[pool] for h in self.hosts if pool in h.pools]
        return sum(r.state == "ready" for part in parts for r in part.replicas)

    async def leave(self) -> None:
        """A clean exit (call it once the loop has stopped, before the workers stop): hand
        the lease over and take this host out of the fleet now; close the client."""
        try:
            await self.keeper.release()
            await self.store.remove_host(self.host_id)
        except Exception as exc:  # Redis gone: the lease and the record lapse by themselves
            log.warning("fleet: leaving cleanly failed (%r); the lease and record lapse", exc)
        finally:
            await self.store.redis.aclose()

    def status(self) -> dict[str, Any]:
        """Per pool, for `GET /admin/fleet`: this host's replicas, the leader's last decision
        and fleet-wide signals (when this host leads) and the fleet: hosts, leader, desired
        replicas, orders this host carried out and refused."""
        holder = self.keeper.holder
        leading = holder.is_leader(self.clock())
        out: dict[str, Any] = {}
        for name in self.pools:
            last = self.leader.autoscaler.last.get(name) if leading else None
            signals = self.leader.last_signals.get(name) if leading else None
            config = self.leader.configs.get(name)
            out[name] = {
                "replicas": [r.to_dict() for r in self.supervisor.pool_replicas(name)],
                "min_replicas": config.min_replicas if config else None,
                "max_replicas": config.max_replicas if config else None,
                "decision": last.to_dict() if last else None,
                "signals": signals.to_dict() if signals else None,  # fleet-wide
                "fleet": {
                    "host_id": self.host_id,
                    "leader": leading,
                    "token": holder.token if leading else None,
                    "desired_replicas": self.desired.get(name),
                    "ready_replicas": self.fleet_ready(name),
                    "hosts": {
                        h.host_id: [r.replica_id for r in h.pools[name].replicas]
                        for h in self.hosts
                        if name in h.pools
                    },
                    "orders_applied": self.agent.num_applied,
                    "orders_refused": self.agent.num_refused,
                },
            }
        return out


def fleet_configs(cfg: ServeConfig) -> dict[str, AutoscalerConfig]:
    """Each pool's policy; without autoscaling, a fixed size of min_replicas."""
    if cfg.fleet.autoscale:
        return {n: autoscaler_config(p) for n, p in cfg.pools.items()}
    return {
        n: AutoscalerConfig(min_replicas=p.min_replicas, max_replicas=p.min_replicas)
        for n, p in cfg.pools.items()
    }


def make_fleet_loop(
    cfg: ServeConfig, gw: Gateway, supervisor: LocalSupervisor, redis_url: str
) -> "FleetLoop | JoinedFleetLoop":
    """The stack's fleet loop: a single host's `FleetLoop`, or with `fleet.join` this
    host's part of the fleet's. Either way its desired replicas per pool go on the
    gateway's /metrics and its status on GET /admin/fleet."""
    fleet: FleetLoop | JoinedFleetLoop
    if cfg.fleet.join:
        host_id = cfg.fleet.host_id
        assert host_id is not None, "join_fleet fills it"
        client = make_redis(redis_url, max_connections=4, retries=1)
        store = FleetStore(client)
        fleet = JoinedFleetLoop(
            gw.pools,
            supervisor,
            store,
            host_id,
            fleet_configs(cfg),
            lease_config(cfg),
            cfg.fleet.interval_s,
            cfg.fleet.rate_window_s,
            # Members and plain gateways' demand in the fleet's Redis (one Redis: the
            # members join it, the gateways read members from it).
            members=MembershipStore(client),
            demand=DemandStore(client),
        )
    else:
        autoscaler = Autoscaler(fleet_configs(cfg)) if cfg.fleet.autoscale else None
        fleet = FleetLoop(
            gw.pools,
            supervisor,
            autoscaler,
            cfg.fleet.interval_s,
            rate_window_s=cfg.fleet.rate_window_s,
        )
    export_desired_replicas(gw.registry, lambda: desired_replicas(cfg, fleet))
    gw.fleet_status = fleet.status
    return fleet


def desired_replicas(cfg: ServeConfig, fleet: "FleetLoop | JoinedFleetLoop") -> dict[str, int]:
    """Per pool, the replicas the fleet's autoscaler wants: the leader's as published (a
    fleet), the last decision's (one host), min_replicas (autoscaling off)."""
    if isinstance(fleet, JoinedFleetLoop):
        return dict(fleet.desired)
    if fleet.autoscaler is None:
        return {n: p.min_replicas for n, p in cfg.pools.items()}
    return {n: d.desired_replicas for n, d in fleet.autoscaler.last.items()}
