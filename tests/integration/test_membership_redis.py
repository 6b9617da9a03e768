"""Fleet membership on a real Redis with an injected clock: the scripts take `now` from
the test instead of the server, so deadlines, staleness and the pool's model are checked
at exact instants, without sleeping (workers/api/membership*.py, workers/fleet/announcer.py,
gateway/capacity/membership.py)."""

import asyncio
import time
from collections.abc import Iterator

import msgspec
import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

from gateway.capacity.fair_queue import QueueConfig
from gateway.capacity.membership import MembershipWatcher
from gateway.capacity.pool import Pool
from gateway.config import MembershipConfig
from tests.support.redis_server import redis_url as start_redis
from workers.api.membership import (
    CHANNEL,
    MemberRecord,
    member_id_for,
    members_key,
    records_key,
)
from workers.api.membership_store import MembershipStore
from workers.fleet.announcer import Announcer

FP, OTHER = "m1-aaaa", "m1-bbbb"
T0 = 1_700_000_000_000  # ms


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with start_redis() as url:
        yield url


class Clock:
    def __init__(self) -> None:
        self.now_ms = T0

    def __call__(self) -> int:
        return self.now_ms


def record(url: str, fingerprint: str = FP, state: str = "ready") -> MemberRecord:
    return MemberRecord(
        pool="small",
        member_id=member_id_for(url),
        url=url,
        model="smol",
        fingerprint=fingerprint,
        host_id="h1",
        state=state,  # type: ignore[arg-type]
    )


def on_redis(url: str, body) -> None:  # noqa: ANN001
    """`asyncio.run(body(client))` on a flushed database."""

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(url)
        try:
            await client.flushdb()
            await body(client)
        finally:
            await client.aclose()

    asyncio.run(main())


def make_watcher(store: MembershipStore, clock: Clock, poll_s: float = 1.0):  # noqa: ANN201
    pool = Pool("small", [], None, QueueConfig(), 4)  # type: ignore[arg-type]
    registry = CollectorRegistry()
    cfg = MembershipConfig(enabled=True, ttl_s=6.0, poll_s=poll_s)
    return MembershipWatcher(store, {"small": pool}, cfg, registry, clock_ms=clock), pool, registry


def test_a_member_is_read_until_its_deadline_then_pruned(redis_url: str) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        store = MembershipStore(client)
        reply = await store.announce(record("http://a:1"), 6.0, now_ms=T0)
        assert reply.matches and reply.pool_fingerprint == FP
        just_before = (await store.read(["small"], now_ms=T0 + 5_999))["small"]
        assert [m.record.url for m in just_before.members] == ["http://a:1"]
        assert just_before.members[0].deadline_ms == T0 + 6_000
        assert just_before.fingerprint == FP
        at_deadline = (await store.read(["small"], now_ms=T0 + 6_000))["small"]
        assert at_deadline.members == [] and at_deadline.fingerprint is None
        assert await client.zcard(members_key("small")) == 0
        assert await client.hlen(records_key("small")) == 0

    on_redis(redis_url, body)


def test_the_pools_model_is_its_first_members_until_no_member_holds_it(redis_url: str) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        store = MembershipStore(client)
        clock = Clock()
        first = Announcer(store, 6.0, "first", clock)
        other = Announcer(store, 6.0, "other", clock)
        first.add(lambda: record("http://a:1"))
        key = other.add(lambda: record("http://b:1", OTHER))
        await first.heartbeat()
        clock.now_ms = T0 + 1_000
        await other.heartbeat()
        assert other.members[key].refused  # and logged, once
        read = (await store.read(["small"], now_ms=T0 + 1_000))["small"]
        assert read.fingerprint == FP and len(read.members) == 2
        # The first member dies at T0; the other keeps heartbeating. At T0 + 6 s no member
        # of FP is left, so the pool's model lapses and the next heartbeat sets its own.
        clock.now_ms = T0 + 5_999
        await other.heartbeat()
        assert other.members[key].refused
        clock.now_ms = T0 + 6_000
        await other.heartbeat()
        assert not other.members[key].refused
        read = (await store.read(["small"], now_ms=T0 + 6_000))["small"]
        assert read.fingerprint == OTHER
        assert [m.record.url for m in read.members] == ["http://b:1"]

    on_redis(redis_url, body)


@pytest.mark.parametrize("kill_after_heartbeat_ms", [1, 1_000, 1_999])
@pytest.mark.parametrize("poll_phase_ms", [0, 400, 999])
def test_a_member_that_dies_leaves_the_rotation_within_ttl_plus_poll_and_not_before_its_deadline(
    redis_url: str, kill_after_heartbeat_ms: int, poll_phase_ms: int
) -> None:
    """Heartbeats every TTL/3 (2 s) until the member is killed; the gateway reads every
    poll (1 s, at some phase). Every read before the deadline keeps the member; the first
    read at or past it removes it, no later than TTL + poll after the death."""

    async def body(client: redis.asyncio.Redis) -> None:
        store = MembershipStore(client)
        clock = Clock()
        announcer = Announcer(store, 6.0, "w", clock)
        announcer.add(lambda: record("http://a:1"))
        watcher, pool, registry = make_watcher(store, clock)
        killed_at = T0 + 4_000 + kill_after_heartbeat_ms
        heartbeats = [T0 + k * 2_000 for k in range(10) if T0 + k * 2_000 < killed_at]
        reads = [T0 + poll_phase_ms + j * 1_000 for j in range(1, 20)]
        events = sorted([(t, "heartbeat") for t in heartbeats] + [(t, "read") for t in reads])
        removed_at = None
        for t, what in events:
            clock.now_ms = t
            if what == "heartbeat":
                await announcer.heartbeat()
                continue
            await watcher.sync()
            present = "http://a:1" in pool.views
            if t < heartbeats[-1] + 6_000:
                assert present, f"removed at {t - T0} ms, before its deadline"
            elif removed_at is None:
                assert not present
                removed_at = t
        assert removed_at is not None
        assert removed_at - killed_at <= 6_000 + 1_000
        assert (
            registry.get_sample_value(
                "switchyard_gateway_membership_changes_total", {"pool": "small", "change": "lost"}
            )
            == 1
        )

    on_redis(redis_url, body)


def test_a_withdrawal_is_a_tombstone_every_gateway_reads_as_left(redis_url: str) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        store = MembershipStore(client)
        clock = Clock()
        announcer = Announcer(store, 6.0, "w", clock)
        pool_name, member_id = announcer.add(lambda: record("http://a:1"))
        await announcer.heartbeat()
        gateways = [make_watcher(store, clock) for _ in range(2)]
        for watcher, pool, _ in gateways:
            await watcher.sync()
            assert "http://a:1" in pool.views
        clock.now_ms = T0 + 3_000
        await announcer.withdraw(pool_name, member_id)
        assert announcer.members == {}
        read = (await store.read(["small"], now_ms=T0 + 8_999))["small"]
        assert [m.record.state for m in read.members] == ["withdrawn"]
        clock.now_ms = T0 + 8_999  # a gateway reading late still sees it left on purpose
        for watcher, pool, registry in gateways:
            await watcher.sync()
            assert pool.views == {}
            assert (
                registry.get_sample_value(
                    "switchyard_gateway_membership_changes_total",
                    {"pool": "small", "change": "left"},
                )
                == 1
            )
        assert (await store.read(["small"], now_ms=T0 + 9_000))["small"].members == []

    on_redis(redis_url, body)


def test_joins_and_state_changes_are_published_and_plain_heartbeats_are_not(
    redis_url: str,
) -> None:
    async def next_message(pubsub, kind: str = "message") -> bytes:  # noqa: ANN001
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            message = await pubsub.get_message(timeout=1.0)
            if message is not None and message["type"] == kind:
                return message["data"]
        raise AssertionError(f"no {kind} message")

    async def body(client: redis.asyncio.Redis) -> None:
        store = MembershipStore(client)
        pubsub = store.subscribe()
        await pubsub.subscribe(CHANNEL)
        await next_message(pubsub, "subscribe")  # confirmed: nothing published is missed
        state = {"now": "starting"}
        announcer = Announcer(store, 6.0, "w")
        announcer.add(lambda: record("http://a:1", state=state["now"]))
        await announcer.heartbeat()  # new: published
        assert await next_message(pubsub) == b"small"
        await announcer.heartbeat()  # nothing changed: silent
        await client.publish(CHANNEL, "sentinel")  # so the next message says which came first
        assert await next_message(pubsub) == b"sentinel"
        state["now"] = "ready"
        await announcer.heartbeat()
        assert await next_message(pubsub) == b"small"
        await pubsub.aclose()

    on_redis(redis_url, body)


def test_a_watcher_reacts_to_a_change_message_long_before_its_next_poll(redis_url: str) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        store = MembershipStore(client)
        watcher, pool, _ = make_watcher(store, Clock(), poll_s=60.0)
        watcher.clock_ms = None  # the server's clock, as in production
        task = asyncio.ensure_future(watcher.run())
        try:
            await _until(lambda: watcher.subscribed, 10.0)
            announcer = Announcer(store, 6.0, "w")
            announcer.add(lambda: record("http://a:1"))
            t0 = time.monotonic()
            await announcer.heartbeat()
            await _until(lambda: "http://a:1" in pool.views, 10.0)
            assert time.monotonic() - t0 < 10.0 < watcher.config.poll_s
            await announcer.close()  # withdraws: out at once too
            await _until(lambda: "http://a:1" not in pool.views, 10.0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    on_redis(redis_url, body)


def test_a_malformed_record_is_skipped_and_counted(redis_url: str) -> None:
    async def body(client: redis.asyncio.Redis) -> None:
        store = MembershipStore(client)
        await store.announce(record("http://a:1"), 6.0, now_ms=T0)
        await client.zadd(members_key("small"), {"b:1": T0 + 6_000})
        await client.hset(records_key("small"), "b:1", b'{"pool": "small", "url": 3}')
        fake = msgspec.json.encode(record("http://c:1"))
        await client.zadd(members_key("small"), {"x:1": T0 + 6_000})
        await client.hset(records_key("small"), "x:1", fake)  # c's record under x's id
        read = (await store.read(["small"], now_ms=T0 + 1))["small"]
        assert [m.record.url for m in read.members] == ["http://a:1"]
        assert read.num_malformed == 2

    on_redis(redis_url, body)


async def _until(predicate, timeout_s: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def test_a_supervisors_replicas_are_announced_for_other_hosts_and_withdrawn(
    redis_url: str, tmp_path
) -> None:
    """`switchyard serve` with membership on: its replicas join its own gateway by method
    call and are announced for the others (cli/serve/announce.py)."""
    import json

    from cli.serve.announce import AnnouncedMembership, pool_model
    from cli.serve.fleet import PoolMembership
    from workers.models.fingerprint import model_fingerprint

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": 8}))
    local_url, advertised = "http://127.0.0.1:9001", "http://10.0.0.5:9001"

    async def body(client: redis.asyncio.Redis) -> None:
        store = MembershipStore(client)
        announcer = Announcer(store, 6.0, "serve-a")
        own_pools = {"small": Pool("small", [], None, QueueConfig(), 4)}  # type: ignore[arg-type]
        models = {"small": pool_model("small", model_dir, {"scheduler": {"max_num_seqs": 8}})}
        announced = AnnouncedMembership(
            PoolMembership(own_pools), announcer, models, "host-a",
            advertise=lambda url: url.replace("127.0.0.1", "10.0.0.5"),
        )  # fmt: skip
        announced.add("small", local_url)
        await announcer.heartbeat()
        (live,) = (await store.read(["small"]))["small"].members
        r = live.record
        assert (r.url, r.state, r.host_id, r.max_num_seqs) == (advertised, "starting", "host-a", 8)
        assert r.fingerprint == model_fingerprint(model_dir) and r.announcer == "serve-a"
        assert own_pools["small"].origins == {local_url: "local"}

        own = MembershipWatcher(
            store, own_pools, MembershipConfig(enabled=True), CollectorRegistry(),
            skip_announcer="serve-a",
        )  # fmt: skip
        await own.sync()  # its own replica, already there by method call: left alone
        assert own_pools["small"].origins == {local_url: "local"}
        other, other_pool, _ = make_watcher(store, Clock())
        other.clock_ms = None
        await other.sync()  # another host's gateway routes to it at its advertised URL
        assert other_pool.origins == {advertised: "joined"}

        announced.remove("small", local_url, lost=False)
        await asyncio.gather(*announced._tasks)
        assert own_pools["small"].views == {}
        await other.sync()
        assert other_pool.views == {}
        (tomb,) = (await store.read(["small"]))["small"].members
        assert tomb.record.state == "withdrawn"

    on_redis(redis_url, body)
