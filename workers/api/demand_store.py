"""Gateways' demand reports in Redis (layout: `workers.api.demand`): a gateway publishes,
the fleet's leader reads. Every call may raise redis ConnectionError or TimeoutError;
each is safe to send again."""

import redis.asyncio

from workers.api.demand import (
    DEMAND_GATEWAYS_KEY,
    GatewayDemand,
    PoolDemand,
    decode_demand,
    demand_key,
    encode_demand,
)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class DemandStore:
    def __init__(self, redis_client: redis.asyncio.Redis) -> None:
        self.redis = redis_client

    async def publish(self, gateway_id: str, pools: dict[str, PoolDemand], ttl_s: float) -> None:
        """Replace `gateway_id`'s report with `pools`, alive `ttl_s` from now (one MULTI:
        a reader never sees half a report)."""
        key = demand_key(gateway_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if pools:
                pipe.hset(key, mapping={p: encode_demand(d) for p, d in sorted(pools.items())})
                pipe.pexpire(key, max(1, int(ttl_s * 1000)))
            pipe.sadd(DEMAND_GATEWAYS_KEY, gateway_id)
            await pipe.execute()

    async def withdraw(self, gateway_id: str) -> None:
        """A gateway leaving cleanly: its report goes now, not at its expiry."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(demand_key(gateway_id))
            pipe.srem(DEMAND_GATEWAYS_KEY, gateway_id)
            await pipe.execute()

    async def read(self) -> list[GatewayDemand]:
        """Every live gateway's report (malformed pools left out); the ids of expired
        reports are dropped from the set as a side effect."""
        ids = sorted(_text(i) for i in await self.redis.smembers(DEMAND_GATEWAYS_KEY))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for gateway_id in ids:
                pipe.hgetall(demand_key(gateway_id))
            replies = await pipe.execute()
        out, gone = [], []
        for gateway_id, raw in zip(ids, replies, strict=True):
            if not raw:
                gone.append(gateway_id)
                continue
            pools = {}
            for pool, body in raw.items():
                demand = decode_demand(body)
                if demand is not None:
                    pools[_text(pool)] = demand
            out.append(GatewayDemand(gateway_id, pools))
        if gone:
            await self.redis.srem(DEMAND_GATEWAYS_KEY, *gone)
        return out
