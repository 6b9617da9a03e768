"""The autoscaling policy as pure decisions over factory-built signals and a fake clock."""

import json

from tests.unit.fleet.factories import make_config, make_pool, make_replica
from workers.fleet.autoscaler import Autoscaler, choose_victims, recommend
from workers.fleet.signals import PoolSignals


def run(scaler: Autoscaler, signals: PoolSignals, start_s: float, end_s: float):
    """Decide once a second over [start_s, end_s] on the same signals; the last decision."""
    decision = None
    t = start_s
    while t <= end_s:
        decision = scaler.decide(signals, t)
        t += 1.0
    assert decision is not None
    return decision


def test_target_is_absolute_demand_over_per_replica_capacity() -> None:
    # 20 req/s x 4 s = 80 concurrent sequences / 8 per replica = 10, from 2 replicas.
    config = make_config(max_replicas=20)
    rec = recommend(make_pool(num_ready=2, arrivals_per_s=20.0), config)
    assert rec.num_replicas == 10 and rec.complete
    # A queue adds the capacity that clears it within backlog_drain_s: 120 x 4 / 60 = 8.
    rec = recommend(make_pool(num_ready=2, arrivals_per_s=20.0, queue_depth=120), config)
    assert rec.num_replicas == 10 + 1


def test_scales_up_within_the_short_window() -> None:
    scaler = Autoscaler({"small": make_config()})
    calm = make_pool(num_ready=2, running_each=8, arrivals_per_s=4.0)
    assert scaler.decide(calm, 0.0).is_noop
    burst = make_pool(num_ready=2, running_each=8, arrivals_per_s=12.0)
    scaler.decide(burst, 1.0)  # one tick is not enough: the window still holds 2
    decision = scaler.decide(burst, 3.0)  # by the end of the 2 s window it is
    assert decision.num_start == 6 - 2 and decision.desired_replicas == 6
    assert decision.reason.startswith("scale up")


def test_starting_replicas_count_as_capacity_already_ordered() -> None:
    scaler = Autoscaler({"small": make_config()})
    overload = make_pool(num_ready=2, running_each=8, queue_depth=0, arrivals_per_s=12.0)
    first = run(scaler, overload, 0.0, 3.0)
    assert first.num_start == 4
    # The same overload while those 4 start (the queue growing): no 2 -> 4 -> 8.
    for t in range(4, 30):
        starting = make_pool(num_ready=2, num_starting=4, running_each=8, arrivals_per_s=12.0)
        assert scaler.decide(starting, float(t)).num_start == 0


def test_up_tolerance_keeps_arrival_noise_from_ordering_a_replica() -> None:
    # 6.2 replicas' worth of demand: within a quarter replica of 6, so 6.
    signals = make_pool(num_ready=6, arrivals_per_s=12.4)
    assert recommend(signals, make_config(up_tolerance=0.25)).num_replicas == 6
    assert recommend(signals, make_config(up_tolerance=0.0)).num_replicas == 7


def test_scales_down_only_to_the_highest_recommendation_of_the_long_window() -> None:
    scaler = Autoscaler({"small": make_config(scale_down_window_s=60.0)})
    busy = make_pool(num_ready=6, running_each=8, arrivals_per_s=12.0)
    run(scaler, busy, 0.0, 10.0)
    quiet = make_pool(num_ready=6, running_each=1, arrivals_per_s=1.0)
    held = run(scaler, quiet, 11.0, 69.0)  # the busy ticks are still in the window
    assert held.is_noop and held.desired_replicas == 6
    dropped = scaler.decide(quiet, 71.0)
    assert dropped.desired_replicas == 1 and len(dropped.drain) == 5
    assert dropped.reason.startswith("scale down")


def test_a_brief_dip_inside_the_long_window_does_not_scale_down() -> None:
    scaler = Autoscaler({"small": make_config()})
    busy = make_pool(num_ready=6, running_each=8, arrivals_per_s=12.0)
    quiet = make_pool(num_ready=6, running_each=1, arrivals_per_s=1.0)
    for t in range(0, 120):
        signals = quiet if t % 30 >= 20 else busy
        assert scaler.decide(signals, float(t)).drain == ()


def test_missing_metrics_never_scale_down() -> None:
    scaler = Autoscaler({"small": make_config(scale_down_window_s=10.0)})
    no_rate = make_pool(num_ready=6, running_each=0, arrivals_per_s=None)
    no_queue = make_pool(num_ready=6, running_each=0, queue_depth=None)
    no_service = make_pool(num_ready=6, running_each=0, mean_service_s=None)
    silent = PoolSignals(
        pool="small",
        replicas=(make_replica("r0", num_running=None, kv_used_tokens=None),)
        + tuple(make_replica(f"r{i}") for i in range(1, 6)),
        queue_depth=0,
        arrivals_per_s=0.0,
        mean_service_s=4.0,
    )
    for signals in (no_rate, no_queue, no_service, silent):
        decision = run(scaler, signals, 0.0, 60.0)
        assert decision.drain == () and decision.desired_replicas == 6
        assert "metrics missing" in decision.reason


def test_missing_metrics_still_scale_up_on_what_is_there() -> None:
    scaler = Autoscaler({"small": make_config()})
    # No arrival rate, but 64 queued and every slot busy: scale up on running + backlog.
    signals = make_pool(num_ready=2, running_each=8, queue_depth=64, arrivals_per_s=None)
    assert run(scaler, signals, 0.0, 3.0).desired_replicas > 2


def test_ttft_over_slo_holds_scale_down() -> None:
    scaler = Autoscaler({"small": make_config(scale_down_window_s=5.0)})
    slow = make_pool(num_ready=6, running_each=1, arrivals_per_s=1.0, ttft_p90_s=3.0)
    decision = run(scaler, slow, 0.0, 30.0)
    assert decision.drain == () and "SLO" in decision.reason


def test_bounds_keep_a_warm_pool_and_a_ceiling() -> None:
    scaler = Autoscaler({"small": make_config(min_replicas=2, max_replicas=5)})
    idle = make_pool(num_ready=3, arrivals_per_s=0.0)
    assert run(scaler, idle, 0.0, 100.0).desired_replicas == 2
    scaler = Autoscaler({"small": make_config(min_replicas=2, max_replicas=5)})
    flood = make_pool(num_ready=2, running_each=8, queue_depth=5000, arrivals_per_s=100.0)
    assert run(scaler, flood, 0.0, 5.0).desired_replicas == 5


def test_victims_are_starting_replicas_first_then_fewest_resident_tokens() -> None:
    replicas = [
        make_replica("busy", kv_used_tokens=5000, num_running=6),
        make_replica("light", kv_used_tokens=300, num_running=6),
        make_replica("s-old", "starting", ordered_at_s=10.0),
        make_replica("s-new", "starting", ordered_at_s=20.0),
        make_replica("leaving", "draining", kv_used_tokens=0),
        make_replica("stuck", "stalled", kv_used_tokens=0),
    ]
    assert choose_victims(replicas, 3) == ["s-new", "s-old", "light"]
    assert choose_victims(replicas, 10) == ["s-new", "s-old", "light", "busy"]


def test_decision_serialises_with_its_reason() -> None:
    scaler = Autoscaler({"small": make_config()})
    decision = run(scaler, make_pool(num_ready=2, running_each=8, arrivals_per_s=12.0), 0, 3)
    body = json.loads(json.dumps(decision.to_dict()))
    assert body["pool"] == "small" and body["num_start"] == 4 and body["reason"]
    assert scaler.last["small"] == decision


def _with(signals: PoolSignals, *extra, startable: int | None = None) -> PoolSignals:
    from dataclasses import replace

    return replace(signals, replicas=signals.replicas + extra, startable=startable)


def test_a_stalled_replica_is_capacity_already_ordered_and_never_replaced() -> None:
    """The supervisor restarts a stall; ordering a replacement too would leave one replica
    too many once it is back (the tour's large pool, max 1, ran 2)."""
    scaler = Autoscaler({"small": make_config(max_replicas=2)})
    busy = make_pool(num_ready=1, running_each=8, arrivals_per_s=4.0)  # demand: 2 replicas
    stalled = _with(busy, make_replica("r9", "stalled", num_running=4))
    for t in range(10):
        assert run(scaler, stalled, float(t), float(t)).num_start == 0


def test_draining_replicas_count_against_max_replicas() -> None:
    scaler = Autoscaler({"small": make_config(max_replicas=2)})
    burst = make_pool(num_ready=1, running_each=8, arrivals_per_s=12.0)  # wants 6
    draining = _with(burst, make_replica("r9", "draining", num_running=8))
    decision = run(scaler, draining, 0.0, 5.0)
    assert decision.num_start == 0 and decision.desired_replicas == 1
    assert "bounded by max_replicas 2 counting every replica" in decision.reason
    alone = run(Autoscaler({"small": make_config(max_replicas=2)}), burst, 0.0, 5.0)
    assert alone.num_start == 1  # without the draining one, room for one more


def test_starts_are_bounded_by_the_devices_free_and_the_decision_says_so() -> None:
    scaler = Autoscaler({"small": make_config(max_replicas=10)})
    burst = _with(make_pool(num_ready=2, running_each=8, arrivals_per_s=12.0), startable=1)
    decision = run(scaler, burst, 0.0, 5.0)
    assert decision.num_start == 1 and decision.desired_replicas == 3
    assert "6 wanted, 3 bounded by devices free for 1 more" in decision.reason
    none_free = _with(burst, startable=0)
    assert run(Autoscaler({"small": make_config()}), none_free, 0.0, 5.0).num_start == 0
