"""The leader's view of members no serve host runs and of plain gateways' demand, pure and
on a clock: which live members count as replicas (and toward max_replicas), whose load they
carry, how gateways' reports add to the hosts' demand, and that the leader never orders a
start past max_replicas counting them, nor a drain of one."""

from tests.unit.fleet.factories import make_config
from workers.api.demand import GatewayDemand, MemberLoad, PoolDemand
from workers.api.membership import LiveMember, MemberRecord, PoolMembers
from workers.fleet.autoscaler import Autoscaler
from workers.fleet.hosts import HostRecord, PoolRecord, ReplicaRecord
from workers.fleet.placement import PendingOrders, fleet_signals, plan_orders

FP = "fp-small"


def member(n: int, state: str = "ready", announcer: str = "", fingerprint: str = FP) -> LiveMember:
    url = f"http://10.0.0.{n}:8100"
    record = MemberRecord(
        pool="small",
        member_id=f"10.0.0.{n}:8100",
        url=url,
        model="small",
        fingerprint=fingerprint,
        host_id=f"pod-{n}",
        state=state,  # type: ignore[arg-type]
        announcer=announcer,
    )
    return LiveMember(record, deadline_ms=10_000)


def members(*live: LiveMember) -> PoolMembers:
    return PoolMembers("small", 1_000, FP, list(live))


def load(running: int, kv_used: int = 100, waiting: int = 0) -> MemberLoad:
    return MemberLoad("ready", running, waiting, kv_used, 8000)


def controller(startable: int | None = 0, announcer: str = "", **demand: float) -> HostRecord:
    """A serve host that runs no replica of the pool (Kubernetes' controller)."""
    pool = PoolRecord(
        replicas=[],
        startable=startable,
        queue_depth=int(demand.get("queue_depth", 0)),
        arrivals_per_s=demand.get("arrivals_per_s", 0.0),
        mean_service_s=demand.get("mean_service_s"),
    )
    return HostRecord(host_id="ctl", pools={"small": pool}, announcer=announcer)


def gateway(
    gid: str, arrivals: float, service_s: float, queue: int, **loads: MemberLoad
) -> GatewayDemand:
    urls = {f"http://10.0.0.{k.removeprefix('m')}:8100": v for k, v in loads.items()}
    demand = PoolDemand(
        queue_depth=queue,
        estimated_wait_s=0.5,
        arrivals_per_s=arrivals,
        mean_service_s=service_s,
        ttft_p90_s=0.2,
        members=urls,
    )
    return GatewayDemand(gid, {"small": demand})


def test_live_members_no_host_runs_count_as_replicas() -> None:
    serve_host = HostRecord(
        host_id="a",
        pools={"small": PoolRecord(replicas=[ReplicaRecord("small-0", "ready", 5.0)])},
        announcer="a:1:ab",
    )
    view = members(
        member(1),  # a worker pod: counts
        member(2, state="starting"),  # counts, as starting
        member(3, state="draining"),  # counts, as draining (it is leaving)
        member(4, state="withdrawn"),  # gone on purpose: does not
        member(5, announcer="a:1:ab"),  # host a's own replica, announced: counted once
        member(6, fingerprint="other"),  # another model: refused, no replica
    )
    s = fleet_signals("small", [serve_host], PendingOrders(), 50.0, view)
    states = {r.replica_id: r.state for r in s.replicas}
    assert states == {
        "a/small-0": "ready",
        "member/10.0.0.1:8100": "ready",
        "member/10.0.0.2:8100": "starting",
        "member/10.0.0.3:8100": "draining",
    }
    assert s.num_ordered == 3  # ready and starting; the draining one is leaving
    assert s.startable is None  # what runs the members bounds them, not a's devices


def test_without_members_the_hosts_devices_still_bound_the_pool() -> None:
    s = fleet_signals("small", [controller(startable=0)], PendingOrders(), 0.0, members())
    assert s.replicas == () and s.startable == 0


def test_gateways_demand_adds_to_the_hosts_and_members_carry_the_busiest_load() -> None:
    hosts = [controller(arrivals_per_s=1.0, mean_service_s=2.0, queue_depth=1)]
    reports = [
        gateway("g1", 3.0, 4.0, 2, m1=load(5, 300), m2=MemberLoad("loading")),
        gateway("g2", 4.0, 1.0, 3, m1=load(3, 200), m2=load(1, 50)),
        GatewayDemand("g3", {"large": PoolDemand(queue_depth=99, arrivals_per_s=99.0)}),
    ]
    s = fleet_signals("small", hosts, PendingOrders(), 0.0, members(member(1), member(2)), reports)
    assert s.queue_depth == 1 + 2 + 3 and s.arrivals_per_s == 1.0 + 3.0 + 4.0
    assert s.mean_service_s == (2.0 * 1 + 4.0 * 3 + 1.0 * 4) / 8  # weighted by arrivals
    assert s.estimated_wait_s == 0.5 and s.ttft_p90_s == 0.2
    by_id = {r.replica_id: r for r in s.replicas}
    one, two = by_id["member/10.0.0.1:8100"], by_id["member/10.0.0.2:8100"]
    assert (one.num_running, one.kv_used_tokens, one.kv_total_tokens) == (5, 300, 8000)
    assert (two.num_running, two.kv_used_tokens) == (1, 50)  # a report with numbers wins
    assert one.has_metrics and two.has_metrics


def test_a_member_no_gateway_reports_has_no_metrics_and_holds_scale_down() -> None:
    scaler = Autoscaler({"small": make_config(min_replicas=0)})
    view = members(member(1), member(2))
    for t in range(0, 200, 10):  # no demand at all, for longer than the down window
        s = fleet_signals("small", [controller()], PendingOrders(), float(t), view)
        d = scaler.decide(s, float(t))
    assert not s.replicas[0].has_metrics
    assert d.desired_replicas == 2 and "metrics missing" in d.reason


def test_desired_follows_demand_past_the_hosts_devices_within_max_replicas() -> None:
    """The controller has no room, yet the desired count (what the scalers read) rises with
    the gateways' demand, counting the members as replicas, and stops at max_replicas."""
    scaler = Autoscaler({"small": make_config(min_replicas=1, max_replicas=4)})
    view = members(member(1))
    busy = [gateway("g1", 10.0, 2.0, 0, m1=load(8))]  # 20 slots: 3 replicas of 8
    pending = PendingOrders()
    for t in (0.0, 1.0, 2.0, 3.0):
        s = fleet_signals("small", [controller()], pending, t, view, busy)
        d = scaler.decide(s, t)
    assert d.desired_replicas == 3 and d.num_start == 2
    assert plan_orders(d, [controller()], pending) == []  # no host has room: none ordered
    flood = [gateway("g1", 100.0, 2.0, 50, m1=load(8))]
    for t in (4.0, 5.0, 6.0, 7.0):
        s = fleet_signals("small", [controller()], pending, t, view, flood)
        d = scaler.decide(s, t)
    assert d.desired_replicas == 4  # max_replicas, the member counted
    # Three members already: one more is all max_replicas leaves.
    view3 = members(member(1), member(2), member(3))
    s = fleet_signals("small", [controller()], pending, 8.0, view3, flood)
    assert scaler.decide(s, 8.0).num_start == 1


def test_a_serve_host_is_never_ordered_past_max_replicas_counting_members() -> None:
    serve_host = controller(startable=None)  # unbounded by devices: takes any start
    scaler = Autoscaler({"small": make_config(min_replicas=1, max_replicas=3)})
    view = members(member(1), member(2))
    flood = [gateway("g1", 100.0, 2.0, 50, m1=load(8), m2=load(8))]
    pending = PendingOrders()
    for t in (0.0, 1.0, 2.0, 3.0):
        s = fleet_signals("small", [serve_host], pending, t, view, flood)
        d = scaler.decide(s, t)
    assert d.desired_replicas == 3 and d.num_start == 1
    orders = plan_orders(d, [serve_host], pending)
    assert [(o.host_id, o.num_start) for o in orders] == [("ctl", 1)]


def test_the_leader_never_orders_a_member_drained() -> None:
    scaler = Autoscaler({"small": make_config(min_replicas=1, scale_down_window_s=10.0)})
    view = members(member(1), member(2), member(3))
    idle = [gateway("g1", 0.0, 2.0, 0, m1=load(0), m2=load(0), m3=load(0))]
    pending = PendingOrders()
    for t in range(0, 30):
        s = fleet_signals("small", [controller()], pending, float(t), view, idle)
        d = scaler.decide(s, float(t))
    assert d.desired_replicas == 1 and len(d.drain) == 2  # the scalers take two pods away
    assert all(v.startswith("member/") for v in d.drain)
    assert plan_orders(d, [controller()], pending) == []
