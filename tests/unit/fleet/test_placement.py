"""The leader's fleet-wide view and placement, over host records built from a few numbers:
where new replicas go, what a decision orders each host, and that an order in flight is
counted so the same scale-up is never ordered twice."""

from tests.unit.fleet.factories import make_config
from workers.fleet.autoscaler import Autoscaler
from workers.fleet.hosts import HostRecord, Order, PoolRecord, ReplicaRecord
from workers.fleet.placement import (
    HostRoom,
    PendingOrders,
    fleet_signals,
    hold_drains,
    place_starts,
    plan_orders,
)


def replica(rid: str, state: str = "ready", running: int = 0, age_s: float = 10.0):
    starting = state == "starting"
    return ReplicaRecord(
        rid,
        state,  # type: ignore[arg-type]
        age_s,
        None if starting else running,
        None if starting else 0,
        None if starting else 0,
        8000,
    )


def host(
    host_id: str,
    replicas: list[ReplicaRecord],
    startable: int | None = 4,
    arrivals_per_s: float | None = 0.0,
    queue_depth: int | None = 0,
    mean_service_s: float | None = 4.0,
    last_order_seq: int = 0,
) -> HostRecord:
    pool = PoolRecord(
        replicas=replicas,
        startable=startable,
        queue_depth=queue_depth,
        estimated_wait_s=0.0,
        arrivals_per_s=arrivals_per_s,
        mean_service_s=mean_service_s,
        ttft_p90_s=0.1,
    )
    return HostRecord(host_id=host_id, pools={"small": pool}, last_order_seq=last_order_seq)


def test_starts_go_to_the_host_with_the_most_free_room_one_at_a_time() -> None:
    rooms = [HostRoom("a", 1, 2), HostRoom("b", 3, 0), HostRoom("c", 0, 0)]
    assert place_starts(3, rooms) == {"b": 2, "a": 1}  # b, b (2 left vs a's 1), then a/b tie
    # c has no room: it never gets one, and what does not fit is not placed.
    assert place_starts(10, rooms) == {"b": 3, "a": 1}


def test_ties_go_to_the_host_with_fewer_replicas_then_by_id() -> None:
    assert place_starts(1, [HostRoom("a", 2, 3), HostRoom("b", 2, 1)]) == {"b": 1}
    assert place_starts(1, [HostRoom("b", 2, 1), HostRoom("a", 2, 1)]) == {"a": 1}
    # Hosts not bounded by devices spread by their replica counts.
    unbounded = [HostRoom("a", None, 2), HostRoom("b", None, 0)]
    assert place_starts(3, unbounded) == {"b": 2, "a": 1}


def test_fleet_signals_merge_every_hosts_replicas_and_demand() -> None:
    hosts = [
        host("a", [replica("small-0", running=8)], startable=1, arrivals_per_s=2.0),
        host("b", [replica("small-0", running=4)], startable=2, arrivals_per_s=6.0,
             queue_depth=5, mean_service_s=2.0),
    ]  # fmt: skip
    s = fleet_signals("small", hosts, PendingOrders(), now_s=100.0)
    assert sorted(r.replica_id for r in s.replicas) == ["a/small-0", "b/small-0"]
    assert s.arrivals_per_s == 8.0 and s.queue_depth == 5
    assert s.mean_service_s == (4.0 * 2 + 2.0 * 6) / 8  # weighted by arrivals
    assert s.startable == 3
    assert all(r.ordered_at_s == 90.0 for r in s.replicas)  # ages on the leader's clock


def test_a_host_not_bounded_by_devices_leaves_the_fleet_unbounded() -> None:
    hosts = [host("a", [], startable=1), host("b", [], startable=None)]
    assert fleet_signals("small", hosts, PendingOrders(), 0.0).startable is None


def test_orders_in_flight_count_as_starting_until_the_hosts_record_shows_them() -> None:
    pending = PendingOrders()
    pending.add(7, Order("a", "small", num_start=2))
    hosts = [host("a", [replica("small-0")], startable=3, last_order_seq=6)]
    pending.settle(hosts)
    s = fleet_signals("small", hosts, pending, 0.0)
    assert [r.state for r in s.replicas].count("starting") == 2
    assert s.num_ordered == 3 and s.startable == 1
    # The host took order 7: its record now lists the replicas, the order is settled.
    hosts = [
        host(
            "a",
            [replica("small-0"), replica("small-1", "starting"), replica("small-2", "starting")],
            startable=1,
            last_order_seq=7,
        )
    ]
    pending.settle(hosts)
    assert pending.orders == []
    assert fleet_signals("small", hosts, pending, 0.0).num_ordered == 3


def test_orders_to_a_host_that_left_the_fleet_are_dropped() -> None:
    pending = PendingOrders()
    pending.add(3, Order("gone", "small", num_start=1))
    pending.settle([host("a", [])])
    assert pending.orders == []


def test_a_drain_in_flight_shows_its_replica_draining() -> None:
    pending = PendingOrders()
    pending.add(4, Order("b", "small", drain=["small-0"]))
    hosts = [host("a", [replica("small-0")]), host("b", [replica("small-0")])]
    s = fleet_signals("small", hosts, pending, 0.0)
    states = {r.replica_id: r.state for r in s.replicas}
    assert states == {"a/small-0": "ready", "b/small-0": "draining"}


def test_a_scale_up_is_ordered_once_while_its_order_travels() -> None:
    """The leader decides every tick; the host's record lags. The start ordered at the
    first tick is counted in the second, so the second orders nothing more."""
    scaler = Autoscaler({"small": make_config(scale_up_window_s=0.0, max_replicas=4)})
    hosts = [host("a", [replica("small-0", running=8)], startable=4, arrivals_per_s=4.0)]
    pending = PendingOrders()
    first = scaler.decide(fleet_signals("small", hosts, pending, 0.0), 0.0)
    orders = plan_orders(first, hosts, pending)
    assert orders == [Order("a", "small", num_start=first.num_start, reason=first.reason)]
    assert first.num_start == 1
    pending.add(1, orders[0])
    second = scaler.decide(fleet_signals("small", hosts, pending, 1.0), 1.0)
    assert second.num_start == 0
    assert plan_orders(second, hosts, pending) == []


def test_max_replicas_bounds_the_whole_fleet() -> None:
    scaler = Autoscaler({"small": make_config(scale_up_window_s=0.0, max_replicas=3)})
    hosts = [
        host("a", [replica("small-0", running=8)], startable=4, arrivals_per_s=20.0),
        host("b", [replica("small-0", running=8)], startable=4, arrivals_per_s=20.0),
    ]
    decision = scaler.decide(fleet_signals("small", hosts, PendingOrders(), 0.0), 0.0)
    orders = plan_orders(decision, hosts, PendingOrders())
    assert decision.desired_replicas == 3
    assert sum(o.num_start for o in orders) == 1


def test_drains_go_to_the_hosts_running_the_victims() -> None:
    scaler = Autoscaler({"small": make_config(scale_down_window_s=0.0, min_replicas=1)})
    hosts = [
        host("a", [replica("small-0", running=1)], arrivals_per_s=0.0),
        host("b", [replica("small-0", running=0), replica("small-1", running=0)]),
    ]
    decision = scaler.decide(fleet_signals("small", hosts, PendingOrders(), 0.0), 0.0)
    assert decision.desired_replicas == 1
    orders = plan_orders(decision, hosts, PendingOrders())
    assert orders == [Order("b", "small", drain=["small-0", "small-1"], reason=decision.reason)]


def test_a_new_leader_holds_its_drains() -> None:
    scaler = Autoscaler({"small": make_config(scale_down_window_s=0.0)})
    hosts = [host("a", [replica("small-0"), replica("small-1")])]
    signals = fleet_signals("small", hosts, PendingOrders(), 0.0)
    decision = scaler.decide(signals, 0.0)
    assert decision.drain
    held = hold_drains(decision, signals)
    assert held.is_noop and held.desired_replicas == 2
    assert held.reason.startswith("hold: a new leader")
