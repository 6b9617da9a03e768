"""The simulator conserves requests, and the policy meets its targets on a small trace."""

import dataclasses

from benchmarks.autoscale.baselines import oracle_policy, static_policy
from benchmarks.autoscale.simulate import SimConfig, Trace, make_arrivals, simulate
from workers.fleet.autoscaler import Autoscaler, AutoscalerConfig

SIM = SimConfig(startup_s=20.0, max_replicas=10, dt_s=0.2)
# 4 req/s (3 replicas), then 14 req/s (9 replicas) for 150 s, then 4 again.
BURST = Trace("burst", 420.0, lambda t: 14.0 if 60 <= t < 210 else 4.0)


def policy_for(sim: SimConfig) -> Autoscaler:
    config = AutoscalerConfig(
        min_replicas=sim.min_replicas,
        max_replicas=sim.max_replicas,
        target_running_per_replica=sim.capacity_per_replica * sim.target_utilization,
        scale_down_window_s=60.0,
    )
    return Autoscaler({BURST.name: config})


def test_every_offered_request_is_served_or_refused() -> None:
    arrivals = make_arrivals(BURST, SIM)
    small_queue = dataclasses.replace(SIM, queue_capacity=20)
    for policy, sim in ((policy_for(SIM).decide, SIM), (static_policy(2), small_queue)):
        res = simulate(policy, BURST, sim, arrivals)
        assert res.offered == len(arrivals) > 0
        assert res.served + res.refused == res.offered
        assert len(res.ttft_s) == res.served
    assert res.refused > 0  # the static pool with a short queue did refuse


def test_autoscaler_meets_the_targets_on_a_burst() -> None:
    arrivals = make_arrivals(BURST, SIM)
    res = simulate(policy_for(SIM).decide, BURST, SIM, arrivals)
    lead = simulate(oracle_policy(BURST, SIM, lead_s=SIM.startup_s), BURST, SIM, arrivals)
    assert res.refused_below_max == 0 and res.stream_cuts == 0
    assert res.peak_ordered - res.peak_needed <= 1
    assert res.replica_seconds <= 1.3 * lead.replica_seconds
    # It did scale up, and back down with drains.
    assert res.peak_ordered > SIM.needed(4.0)
    assert any(d.drain for d in res.decisions)


def test_a_drain_with_a_grace_hands_long_streams_over_and_exits_on_time() -> None:
    long = dataclasses.replace(SIM, long_share=0.05, long_service_s=90.0)
    # The burst, and time after it for the scale-down's drains to end within the trace.
    trace = dataclasses.replace(BURST, duration_s=700.0)
    arrivals = make_arrivals(trace, long)
    waiting = simulate(policy_for(long).decide, trace, long, arrivals)
    grace = dataclasses.replace(long, drain_grace_s=10.0)
    handing = simulate(policy_for(grace).decide, trace, grace, arrivals)
    for res in (waiting, handing):
        assert res.served + res.refused == res.offered and res.stream_cuts == 0
        assert len(res.ttft_s) == res.served  # a resumed stream is not a second request
    assert waiting.handed_over == 0 and max(waiting.drain_s) > 30.0
    assert handing.handed_over > 0 and len(handing.resume_stall_s) == handing.handed_over
    assert max(handing.drain_s) <= 10.0 + SIM.dt_s
    assert handing.replica_seconds < waiting.replica_seconds
