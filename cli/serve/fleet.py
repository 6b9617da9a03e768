"""The supervisor's loop inside the gateway process: signals, decisions, membership.

The supervisor runs in the gateway's own process, so pool membership is a method call
(`Pool.add_member` / `remove_member`): no second source of truth to keep in step, no lag
between a replica starting and the gateway knowing it. A stack with several gateways
would need membership in Redis; `switchyard serve` is one machine and one gateway.
"""

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway.capacity.pool import Pool
from workers.fleet.actuator import apply_decision
from workers.fleet.autoscaler import Autoscaler
from workers.fleet.devices import NoDevices
from workers.fleet.signals import PoolSignals
from workers.fleet.supervisor import LocalSupervisor

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0


class PoolMembership:
    """`workers.fleet.supervisor.Membership` over the gateway's pools. `targets_file`: where the
    workers are listed for Prometheus (file_sd JSON, one group per pool; None: nowhere)."""

    def __init__(self, pools: dict[str, Pool], targets_file: Path | None = None) -> None:
        self.pools = pools
        self.targets_file = targets_file
        self._write_targets()

    def add(self, pool: str, url: str) -> None:
        self.pools[pool].add_member(url, origin="local")
        self._write_targets()

    def remove(self, pool: str, url: str, lost: bool) -> None:
        self.pools[pool].remove_member(url, lost=lost)
        self._write_targets()

    def _write_targets(self) -> None:
        if self.targets_file is None:
            return
        groups = [
            {"targets": sorted(urlsplit(u).netloc for u in p.views), "labels": {"pool": name}}
            for name, p in self.pools.items()
        ]
        self.targets_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups, indent=1))
        tmp.replace(self.targets_file)  # Prometheus never reads half a file


def pool_signals(
    pool: Pool, supervisor: LocalSupervisor, window_s: float = RATE_WINDOW_S
) -> PoolSignals:
    """One pool now: the gateway's queue and rates (over `window_s`), the supervisor's
    replicas."""
    arrivals, service_s = pool.rates(window_s)
    wait = pool.estimated_wait_s(window_s)
    return PoolSignals(
        pool=pool.name,
        replicas=supervisor.signals(pool.name),
        queue_depth=pool.controller.num_waiting,
        estimated_wait_s=None if math.isinf(wait) else wait,
        arrivals_per_s=arrivals,
        mean_service_s=service_s,
        ttft_p90_s=pool.ttft_p90_s(window_s),  # streams only; None: none in the window
        startable=supervisor.startable(pool.name),
    )


class FleetLoop:
    """Every `interval_s`: watch the workers, then decide and act per pool."""

    def __init__(
        self,
        pools: dict[str, Pool],
        supervisor: LocalSupervisor,
        autoscaler: Autoscaler | None,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        rate_window_s: float = RATE_WINDOW_S,
    ) -> None:
        self.pools = pools
        self.supervisor = supervisor
        self.autoscaler = autoscaler
        self.interval_s = interval_s
        self.rate_window_s = rate_window_s
        self.clock = clock
        self.last_signals: dict[str, PoolSignals] = {}

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("fleet tick failed")
            await asyncio.sleep(self.interval_s)

    async def step(self) -> None:
        await self.supervisor.tick()
        if self.supervisor.stopping:
            return
        for name, pool in self.pools.items():
            signals = pool_signals(pool, self.supervisor, self.rate_window_s)
            self.last_signals[name] = signals
            if self.autoscaler is None:
                continue
            decision = self.autoscaler.decide(signals, self.clock())
            if not decision.is_noop:
                log.info(
                    "autoscaler %s: %d -> %d (%s)",
                    name,
                    decision.num_ordered,
                    decision.desired_replicas,
                    decision.reason,
                )
            try:
                apply_decision(decision, self.supervisor)
            except NoDevices as exc:  # the signals said there were: another pool took them
                log.warning("autoscaler %s: %s", name, exc)

    def status(self) -> dict[str, Any]:
        """Per pool, for `GET /admin/fleet`: replicas with state and load, the signals and
        the autoscaler's last decision with its reason."""
        out: dict[str, Any] = {}
        for name in self.pools:
            last = self.autoscaler.last.get(name) if self.autoscaler else None
            signals = self.last_signals.get(name)
            config = self.autoscaler.configs.get(name) if self.autoscaler else None
            out[name] = {
                "replicas": [r.to_dict() for r in self.supervisor.pool_replicas(name)],
                "min_replicas": config.min_replicas if config else None,
                "max_replicas": config.max_replicas if config else None,
                "signals": _finite(signals.to_dict()) if signals else None,
                "decision": last.to_dict() if last else None,
                "placement": self._placement(name),
            }
        return out

    def _placement(self, pool: str) -> dict[str, Any] | None:
        """The devices a replica of `pool` gets, and the host's of that kind: total, free."""
        need = self.supervisor.pools[pool].placement
        inventory = self.supervisor.inventory
        if need is None or inventory is None:
            return None
        return {
            "kind": need.kind,
            "per_replica": need.count,
            "host_devices": inventory.total(need.kind),
            "free": list(inventory.free(need.kind)),
            "startable": inventory.startable(need),
        }


def _finite(doc: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in doc.items()
    }
