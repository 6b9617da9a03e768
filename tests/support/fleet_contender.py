"""A fleet lease contender as a process of its own, for tests that kill the leader:

    python -m tests.support.fleet_contender REDIS_URL HOLDER_ID TTL_S

contends for the lease and renews it while held (`workers.fleet.leader.LeaseKeeper`)
until it is killed. Who holds the lease is read from Redis by the test."""

import asyncio
import sys

import redis.asyncio

from workers.fleet.coordination import FleetStore
from workers.fleet.leader import LeaseKeeper
from workers.fleet.lease import LeaseConfig, LeaseHolder


async def contend(url: str, holder_id: str, ttl_s: float) -> None:
    client = redis.asyncio.Redis.from_url(url)
    holder = LeaseHolder(LeaseConfig(ttl_s=ttl_s, margin_s=ttl_s / 10), holder_id)
    print("contending", flush=True)
    await LeaseKeeper(FleetStore(client), holder).run()


if __name__ == "__main__":
    asyncio.run(contend(sys.argv[1], sys.argv[2], float(sys.argv[3])))
