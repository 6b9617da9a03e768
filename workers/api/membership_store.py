"""Fleet membership over Redis (layout and rules: `workers.api.membership`): announce,
withdraw, read, and the change channel. The announcing side (`workers.fleet.announcer`)
and the reading side (the gateways' watcher, the fleet autoscaler) both go through here.

Every call may raise redis ConnectionError or TimeoutError; each is safe to send again."""

from importlib import resources

import redis.asyncio
from redis.asyncio.client import PubSub

from workers.api.membership import (
    CHANNEL,
    LiveMember,
    MemberRecord,
    PoolMembers,
    decode_record,
    encode_record,
    members_key,
    model_key,
    records_key,
)


def _script(name: str) -> str:
    return resources.files("workers.api").joinpath("lua", name).read_text()


def membership_redis(url: str, timeout_s: float = 2.0) -> redis.asyncio.Redis:
    """A client for the membership Redis at `url` with bounded waits (a member or a gateway
    must not hang on a silent network)."""
    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=5,
    )


class AnnounceReply:
    """What an announcement found: the pool's model and whether this member holds it."""

    __slots__ = ("now_ms", "matches", "pool_fingerprint")

    def __init__(self, now_ms: int, matches: bool, pool_fingerprint: str) -> None:
        self.now_ms = now_ms
        self.matches = matches
        self.pool_fingerprint = pool_fingerprint


class MembershipStore:
    """The membership scripts, registered once on `redis`."""

    def __init__(self, redis_client: redis.asyncio.Redis) -> None:
        self.redis = redis_client
        self._announce = redis_client.register_script(_script("membership_announce.lua"))
        self._read = redis_client.register_script(_script("membership_read.lua"))

    async def announce(
        self,
        record: MemberRecord,
        ttl_s: float,
        changed: bool = False,
        now_ms: int | None = None,
    ) -> AnnounceReply:
        """Write `record` with a deadline `ttl_s` from now (Redis server time unless
        `now_ms`); publish the pool's name on the channel when the member is new or
        `changed`. A `withdrawn` record is a tombstone: it does not hold the pool's model."""
        pool = record.pool
        reply = await self._announce(
            keys=[members_key(pool), records_key(pool), model_key(pool)],
            args=[
                record.member_id,
                encode_record(record),
                max(1, int(ttl_s * 1000)),
                record.fingerprint,
                "1" if changed else "0",
                CHANNEL,
                pool,
                "" if now_ms is None else str(now_ms),
                "1" if record.state == "withdrawn" else "0",
            ],
        )
        fingerprint = reply[2].decode() if isinstance(reply[2], bytes) else str(reply[2])
        return AnnounceReply(int(reply[0]), bool(int(reply[1])), fingerprint)

    async def read(self, pools: list[str], now_ms: int | None = None) -> dict[str, PoolMembers]:
        """Each pool's live members (pipelined: one round trip for all), at Redis server
        time unless `now_ms`. Expired members are pruned as a side effect."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for pool in pools:
                await self._read(
                    keys=[members_key(pool), records_key(pool), model_key(pool)],
                    args=["" if now_ms is None else str(now_ms)],
                    client=pipe,
                )
            replies = await pipe.execute()
        return {pool: _parse(pool, reply) for pool, reply in zip(pools, replies, strict=True)}

    def subscribe(self) -> PubSub:
        """A pub/sub connection for the change channel (call `subscribe(CHANNEL)` on it).
        Its first message is the subscription's confirmation (`type: subscribe`): from then
        on nothing published is missed. Each later message's data is the name of a pool
        that changed."""
        return self.redis.pubsub()


def _parse(pool: str, reply: list) -> PoolMembers:
    now_ms = int(reply[0])
    fingerprint = _text(reply[1]) or None
    members: list[LiveMember] = []
    malformed = 0
    for i in range(2, len(reply) - 2, 3):
        member_id = _text(reply[i])
        record = decode_record(reply[i + 2], pool, member_id)
        if record is None:
            malformed += 1
            continue
        members.append(LiveMember(record, int(float(_text(reply[i + 1])))))
    members.sort(key=lambda m: m.record.member_id)
    return PoolMembers(pool, now_ms, fingerprint, members, malformed)


def _text(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
