"""The fleet: per-pool signals, the autoscaling policy and the actuator interface (pure
decision code: no torch, no HTTP, no processes; an import-linter contract holds it), and
the supervisor that starts, health-checks and drains worker processes.

The fleet loop of `switchyard serve` (`cli/serve/fleet.py`) builds `PoolSignals` from the
gateway's pools, calls `Autoscaler.decide`, and hands the `Decision` to the supervisor
with `apply_decision`; docs/architecture.md ("Fleet and autoscaler") describes the loop.
"""
