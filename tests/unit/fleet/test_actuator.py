"""Decisions reach an actuator as drains first, then starts."""

from tests.unit.fleet.factories import make_config, make_pool
from workers.fleet.actuator import RecordingActuator, apply_decision
from workers.fleet.autoscaler import Autoscaler, plan_change


def test_apply_decision_starts_the_missing_replicas() -> None:
    actuator = RecordingActuator()
    scaler = Autoscaler({"small": make_config()})
    signals = make_pool(num_ready=2, running_each=8, arrivals_per_s=12.0)
    for t in range(4):
        decision = scaler.decide(signals, float(t))
    started = apply_decision(decision, actuator)
    assert len(started) == 4
    assert actuator.replicas("small") == dict.fromkeys(started, "starting")


def test_draining_a_starting_replica_cancels_it_and_a_ready_one_drains() -> None:
    actuator = RecordingActuator()
    ready_id = actuator.start_replica("small")
    actuator.mark(ready_id, "ready")
    starting_id = actuator.start_replica("small")
    actuator.drain_replica("small", starting_id)
    actuator.drain_replica("small", ready_id)
    assert actuator.replicas("small") == {ready_id: "draining"}


def test_apply_decision_drains_the_chosen_victims() -> None:
    actuator = RecordingActuator()
    signals = make_pool(num_ready=3, num_starting=1)
    decision = plan_change(signals, 2, now_s=0.0, recommendation=2, reason="test")
    assert apply_decision(decision, actuator) == []
    assert [c[0] for c in actuator.calls] == ["drain", "drain"]
    assert actuator.calls[0][2] == "s0"
