"""The leader over a real Redis with no replica of its own (Kubernetes' controller): the
members that joined the pool (announced through the membership store, as `worker --join`
does) count as replicas, the demand a plain gateway's publisher writes reaches it, and the
desired count it publishes (the gauge the scalers read) follows both, within max_replicas
counting the members; a serve host with room is ordered only what max_replicas leaves."""

import asyncio
import functools

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cli.serve.fleet_metrics import export_desired_replicas
from gateway.capacity.demand import DemandPublisher
from gateway.capacity.fair_queue import QueueConfig
from gateway.capacity.pool import Pool
from workers.api.demand import PoolDemand
from workers.api.demand_store import DemandStore
from workers.api.membership import MemberRecord, member_id_for
from workers.api.membership_store import MembershipStore
from workers.fleet.actuator import RecordingActuator
from workers.fleet.announcer import Announcer
from workers.fleet.autoscaler import AutoscalerConfig
from workers.fleet.coordination import FleetStore
from workers.fleet.hosts import HostRecord, PoolRecord, ReplicaRecord
from workers.fleet.leader import FleetLeader, HostAgent, LeaseKeeper
from workers.fleet.lease import LeaseConfig, LeaseHolder

CONFIG = AutoscalerConfig(
    min_replicas=1,
    max_replicas=4,
    target_running_per_replica=8.0,
    up_tolerance=0.0,
    scale_up_window_s=0.0,
    scale_down_window_s=60.0,
)


def worker(n: int) -> MemberRecord:
    url = f"http://10.1.0.{n}:8100"
    return MemberRecord(
        pool="small",
        member_id=member_id_for(url),
        url=url,
        model="small",
        fingerprint="fp-small",
        host_id=f"worker-pod-{n}",
        state="ready",
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Controller:
    """A serve --join host with the pool and `startable` room (0: Kubernetes' controller),
    reading members and gateways' demand from the same Redis."""

    def __init__(self, store: FleetStore, startable: int | None = 0) -> None:
        self.store = store
        self.startable = startable
        self.actuator = RecordingActuator()
        self.keeper = LeaseKeeper(store, LeaseHolder(LeaseConfig(ttl_s=30.0), "ctl"))
        self.agent = HostAgent(store, "ctl", self.actuator)
        self.leader = FleetLeader(
            store,
            self.keeper,
            {"small": CONFIG},
            members=MembershipStore(store.redis),
            demand=DemandStore(store.redis),
        )
        self.desired: dict[str, int] = {}
        self.registry = CollectorRegistry()
        export_desired_replicas(self.registry, lambda: self.desired)

    async def tick(self) -> None:
        await self.keeper.step()
        await self.agent.take_orders()
        # The replicas its orders started, as its supervisor would report them.
        replicas = [ReplicaRecord(rid, "starting", 1.0) for rid in self.actuator.replicas("small")]
        room = self.startable
        pool = PoolRecord(replicas=replicas, startable=room, queue_depth=0)
        record = HostRecord(host_id="ctl", pools={"small": pool})
        await self.agent.write_record(record, ttl_ms=60_000)
        await self.leader.step()
        self.desired = await self.store.read_desired()

    def gauge(self) -> dict[str, float]:
        text = generate_latest(self.registry).decode()
        return {
            s.labels["pool"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "switchyard_autoscaler_desired_replicas"
        }


def gateway_pool(clock: Clock) -> Pool:
    pool = Pool("small", [], None, QueueConfig(), 4, clock=clock)  # type: ignore[arg-type]
    for n in (1, 2):
        pool.add_member(worker(n).url, origin="joined")
    return pool


@pytest.mark.asyncio
async def test_joined_members_and_a_gateways_demand_drive_the_desired_count(
    store: FleetStore,
) -> None:
    ctl = Controller(store, startable=0)
    announcer = Announcer(MembershipStore(store.redis), ttl_s=30.0)
    for n in (1, 2):
        announcer.add(functools.partial(worker, n))
    await announcer.heartbeat()

    # No demand anywhere: the two joined workers are the pool's replicas (no gateway has
    # their load, so nothing scales down on them), and nothing is ordered to the host.
    await ctl.tick()
    await ctl.tick()  # the first tick of a tenure waits for a record written after it
    assert ctl.gauge() == {"small": 2.0}
    signals = ctl.leader.last_signals["small"]
    assert sorted(r.replica_id for r in signals.replicas) == [
        "member/10.1.0.1:8100",
        "member/10.1.0.2:8100",
    ]

    # A plain gateway's publisher: 200 requests in its 10 s window, each holding a slot
    # 2 s: 40 slots, 5 replicas of 8; max_replicas 4 counting the two members.
    clock = Clock()
    pool = gateway_pool(clock)
    for _ in range(200):
        pool.record_arrival()
    pool.record_completion(held_s=2.0)
    publisher = DemandPublisher(DemandStore(store.redis), {"small": pool}, "gw-a", 0.5, 30.0)
    await publisher.publish()
    await ctl.tick()
    assert ctl.gauge() == {"small": 4.0}
    signals = ctl.leader.last_signals["small"]
    assert signals.arrivals_per_s == 20.0 and signals.mean_service_s == 2.0
    decision = ctl.leader.autoscaler.last["small"]
    assert decision.recommendation == 4 and decision.num_start == 2  # for Kubernetes
    assert ctl.actuator.calls == []  # the controller itself starts nothing
    assert await store.redis.llen(store.orders_key("ctl")) == 0

    # Kubernetes scaled the Deployment: four members now, nothing more wanted.
    for n in (3, 4):
        announcer.add(functools.partial(worker, n))
    await announcer.heartbeat()
    await ctl.tick()
    assert ctl.gauge() == {"small": 4.0}
    assert ctl.leader.autoscaler.last["small"].num_start == 0

    # A second gateway's demand adds to the first's (the leader sums their queues).
    other = DemandStore(store.redis)
    await other.publish("gw-b", {"small": PoolDemand(queue_depth=7)}, ttl_s=30.0)
    await ctl.tick()
    assert ctl.leader.last_signals["small"].queue_depth == 7

    # A gateway that leaves takes its demand with it.
    run = asyncio.ensure_future(publisher.run())
    await asyncio.sleep(0)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    assert [g.gateway_id for g in await DemandStore(store.redis).read()] == ["gw-b"]


@pytest.mark.asyncio
async def test_a_serve_host_with_room_is_ordered_only_what_max_replicas_leaves(
    store: FleetStore,
) -> None:
    host = Controller(store, startable=8)
    announcer = Announcer(MembershipStore(store.redis), ttl_s=30.0)
    for n in (1, 2, 3):
        announcer.add(functools.partial(worker, n))
    await announcer.heartbeat()
    busy = PoolDemand(queue_depth=0, arrivals_per_s=40.0, mean_service_s=2.0)  # 10 wanted
    await DemandStore(store.redis).publish("gw-a", {"small": busy}, ttl_s=30.0)
    for _ in range(4):  # an order written, taken, and the next ticks see its replica
        await host.tick()
    assert host.gauge() == {"small": 4.0}
    assert [verb for verb, _, _ in host.actuator.calls] == ["start"]  # 3 members + 1
    assert len(host.leader.last_signals["small"].replicas) == 4


@pytest.mark.asyncio
async def test_a_report_expires_with_its_ttl_and_its_id_is_dropped(store: FleetStore) -> None:
    demand = DemandStore(store.redis)
    await demand.publish("gw-short", {"small": PoolDemand(queue_depth=1)}, ttl_s=0.2)
    await demand.publish("gw-long", {"small": PoolDemand(queue_depth=2)}, ttl_s=30.0)
    assert sorted(g.gateway_id for g in await demand.read()) == ["gw-long", "gw-short"]
    while await store.redis.exists("sy:{fleet}:demand:gw-short"):
        await asyncio.sleep(0.02)
    assert [g.gateway_id for g in await demand.read()] == ["gw-long"]
    assert await store.redis.smembers("sy:{fleet}:demand_gateways") == {b"gw-long"}
    # A malformed report is left out, not fatal.
    await store.redis.hset("sy:{fleet}:demand:gw-long", "bad", b"{not json")
    (report,) = await demand.read()
    assert list(report.pools) == ["small"]
