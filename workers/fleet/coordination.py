"""The fleet's shared state in Redis: the leader lease, host records, orders, desired counts.

The Lua scripts (`workers/fleet/lua/`, each opening with its KEYS, ARGV and reply) are
registered once on the client. Every key carries the `{fleet}` hash tag, so on a Redis
Cluster they live on one slot and each script touches one slot. Every call may raise
redis ConnectionError or TimeoutError; the callers (`workers.fleet.leader`) treat that
as "no answer" and try again on their next pass.
"""

from dataclasses import dataclass
from importlib import resources

import msgspec
import redis.asyncio

from workers.fleet.hosts import HostRecord, Order, TakenOrder, decode_order, decode_record, encode

PREFIX = "sy:{fleet}:"
ORDERS_TTL_MS = 60_000  # orders to a host that stops taking them lapse after this


def _script(name: str) -> str:
    return resources.files("workers.fleet").joinpath("lua", name).read_text()


def _bytes(value: bytes | str) -> bytes:
    """A reply element, whether the client decodes responses or not."""
    return value.encode() if isinstance(value, str) else bytes(value)


@dataclass(frozen=True, slots=True)
class Acquired:
    token: int | None  # None: another holds the lease
    server_ms: int  # the Redis server's clock when it answered
    remaining_ms: int  # the other holder's lease left (0 when taken)


@dataclass(frozen=True, slots=True)
class TakenOrders:
    accepted: list[TakenOrder]
    refused: list[TakenOrder]  # written by a leader since replaced
    unreadable: int  # entries that did not parse (logged, dropped)


class FleetStore:
    """The fleet's keys and scripts on one client (`prefix` namespaces a test's fleet)."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str = PREFIX) -> None:
        self.redis = client
        self.prefix = prefix
        self.lease_key = prefix + "leader"
        self.token_key = prefix + "token"
        self.order_seq_key = prefix + "order_seq"
        self.hosts_key = prefix + "hosts"
        self.desired_key = prefix + "desired"
        self._acquire = client.register_script(_script("acquire.lua"))
        self._renew = client.register_script(_script("renew.lua"))
        self._release = client.register_script(_script("release.lua"))
        self._give = client.register_script(_script("give_orders.lua"))
        self._take = client.register_script(_script("take_orders.lua"))
        self._write_host = client.register_script(_script("write_host.lua"))
        self._read_hosts = client.register_script(_script("read_hosts.lua"))
        self._publish = client.register_script(_script("publish_desired.lua"))

    def host_key(self, host_id: str) -> str:
        return f"{self.prefix}host:{host_id}"

    def orders_key(self, host_id: str) -> str:
        return f"{self.prefix}orders:{host_id}"

    # -- the lease ------------------------------------------------------------------------

    async def acquire(self, holder_id: str, ttl_ms: int) -> Acquired:
        token, now_ms, remaining = await self._acquire(
            [self.lease_key, self.token_key], [holder_id, ttl_ms]
        )
        return Acquired(int(token) or None, int(now_ms), max(int(remaining), 0))

    async def renew(self, holder_id: str, token: int, ttl_ms: int) -> bool:
        return bool(await self._renew([self.lease_key], [f"{holder_id}|{token}", ttl_ms]))

    async def release(self, holder_id: str, token: int) -> bool:
        return bool(await self._release([self.lease_key], [f"{holder_id}|{token}"]))

    async def highest_token(self) -> int:
        return int(await self.redis.get(self.token_key) or 0)

    # -- orders ---------------------------------------------------------------------------

    async def give_orders(self, token: int, orders: list[Order]) -> list[int] | None:
        """The seq of each order, or None: `token` is stale and nothing was written."""
        if not orders:
            return []
        keys = [self.token_key, self.order_seq_key, *(self.orders_key(o.host_id) for o in orders)]
        reply = await self._give(keys, [token, ORDERS_TTL_MS, *(encode(o) for o in orders)])
        if int(reply[0]) != 1:
            return None
        return [int(seq) for seq in reply[1:]]

    async def take_orders(self, host_id: str) -> TakenOrders:
        """Every order queued for `host_id`, split by whether its token is still the
        newest (`accepted`) or its leader has been replaced since (`refused`)."""
        reply = await self._take([self.token_key, self.orders_key(host_id)], [])
        highest = int(reply[0])
        accepted: list[TakenOrder] = []
        refused: list[TakenOrder] = []
        unreadable = 0
        for entry in reply[1:]:
            try:
                token_b, seq_b, body = _bytes(entry).split(b"|", 2)
                taken = TakenOrder(decode_order(body), int(token_b), int(seq_b))
            except (ValueError, msgspec.DecodeError):
                unreadable += 1
                continue
            (accepted if taken.token >= highest else refused).append(taken)
        return TakenOrders(accepted, refused, unreadable)

    # -- host records ---------------------------------------------------------------------

    async def write_host(self, record: HostRecord, ttl_ms: int) -> int:
        """Write `record` (its `written_at_ms` is stamped by the server); the server ms."""
        return int(
            await self._write_host(
                [self.host_key(record.host_id), self.hosts_key],
                [record.host_id, encode(record), ttl_ms],
            )
        )

    async def read_hosts(self) -> tuple[list[HostRecord], int, int]:
        """Every live host's record, the server's ms, and how many records did not parse."""
        reply = await self._read_hosts([self.hosts_key], [self.host_key("")])
        now_ms = int(reply[0])
        records, unreadable = [], 0
        for i in range(1, len(reply) - 2, 3):
            try:
                records.append(decode_record(_bytes(reply[i + 1]), int(reply[i + 2])))
            except (ValueError, msgspec.DecodeError):
                unreadable += 1
        return records, now_ms, unreadable

    async def remove_host(self, host_id: str) -> None:
        """A host leaving cleanly: its record goes now, not at its expiry."""
        await self.redis.delete(self.host_key(host_id))
        await self.redis.zrem(self.hosts_key, host_id)

    # -- desired replicas -----------------------------------------------------------------

    async def publish_desired(self, token: int, desired: dict[str, int]) -> bool:
        if not desired:
            return True
        args: list[str | int] = [token]
        for pool, count in sorted(desired.items()):
            args += [pool, count]
        return bool(await self._publish([self.token_key, self.desired_key], args))

    async def read_desired(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.desired_key)
        return {_bytes(k).decode(): int(v) for k, v in raw.items()}
