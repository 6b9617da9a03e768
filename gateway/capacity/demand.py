"""This gateway's demand, published for the fleet's autoscaler (`workers.api.demand`).

A plain `switchyard gateway` (the Kubernetes gateway Deployment) runs no supervisor and
writes no host record, so without this the fleet's leader would never see the requests it
queues. Every `interval_s` the publisher writes each watched pool's queue, rates and the
load of every member it routes to under this process's gateway id, with a TTL of a few
intervals: a gateway that dies leaves the leader's sums within that TTL. A `serve` host's
gateway does not publish (its host record carries the same numbers).
"""

import asyncio
import logging
import math
import os

from gateway.capacity.pool import Pool
from workers.api.demand import MemberLoad, PoolDemand
from workers.api.demand_store import DemandStore
from workers.api.membership import process_identity

log = logging.getLogger(__name__)


def member_loads(pool: Pool) -> dict[str, MemberLoad]:
    """Each member's load as this gateway last polled it (URL -> load); a member that has
    not answered a poll yet reports its state only."""
    out = {}
    for url, view in pool.views.items():
        if not view.answered:
            out[url] = MemberLoad(view.state)
            continue
        total = view.kv_total_tokens or None
        used = None if total is None else max(total - view.kv_free_tokens, 0)
        out[url] = MemberLoad(view.state, view.num_running, view.num_waiting, used, total)
    return out


def pool_demand(pool: Pool, window_s: float) -> PoolDemand:
    """`pool` now: the queue, the rates over `window_s`, its members' load."""
    arrivals, service_s = pool.rates(window_s)
    wait = pool.estimated_wait_s(window_s)
    return PoolDemand(
        queue_depth=pool.controller.num_waiting,
        estimated_wait_s=None if math.isinf(wait) else wait,
        arrivals_per_s=arrivals,
        mean_service_s=service_s,
        ttft_p90_s=pool.ttft_p90_s(window_s),
        members=member_loads(pool),
    )


def new_gateway_id() -> str:
    """This process among the fleet's gateways (host, pid and a nonce)."""
    return process_identity(os.uname().nodename)


class DemandPublisher:
    """Publishes `pools`' demand every `interval_s` with a TTL of `ttl_s`."""

    def __init__(
        self,
        store: DemandStore,
        pools: dict[str, Pool],
        gateway_id: str | None = None,
        interval_s: float = 1.0,
        ttl_s: float = 5.0,
        window_s: float = 10.0,
    ) -> None:
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"need 0 < interval_s < ttl_s, got {interval_s}, {ttl_s}")
        self.store = store
        self.pools = pools
        self.gateway_id = gateway_id or new_gateway_id()
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.window_s = window_s
        self.num_failed = 0

    def report(self) -> dict[str, PoolDemand]:
        return {name: pool_demand(pool, self.window_s) for name, pool in self.pools.items()}

    async def publish(self) -> None:
        await self.store.publish(self.gateway_id, self.report(), self.ttl_s)

    async def run(self) -> None:
        """Publish until cancelled; then withdraw the report (best effort: else it
        expires)."""
        task = asyncio.current_task()
        try:
            while True:
                try:
                    await self.publish()
                except Exception as exc:  # noqa: BLE001 (redis errors: try again next time)
                    self.num_failed += 1
                    log.warning("demand report not published (%r); trying again", exc)
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError  # cancelled mid-call: the client ate it
                await asyncio.sleep(self.interval_s)
        finally:
            try:
                await asyncio.wait_for(self.store.withdraw(self.gateway_id), 1.0)
            except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001
                log.info("demand report left to expire (%r)", exc)
