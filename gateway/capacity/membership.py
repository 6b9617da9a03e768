"""Pool members from the fleet's Redis (`workers.api.membership`): the gateway's watcher.

Every gateway process reads the same membership: it subscribes to the change channel and
re-reads its pools at once on a message, and re-reads every `poll_s` regardless, so a
lost message costs at most one poll. A member that dies without withdrawing is gone from
Redis's reads at its deadline (its last heartbeat plus its TTL), so it leaves this
gateway's rotation within TTL + poll_s of its death.

Reconciling a pool touches only the members the watcher added ("joined"): static URLs
from config and a local supervisor's replicas stay as they are. A member is routed to
while `starting` or `ready`; `draining` or `withdrawn` takes it out at once, its requests
finishing; a member gone from Redis altogether is removed as lost (requests waiting on
its answer stop waiting). A member whose model fingerprint is not the pool's is refused:
logged and counted once, never added.

While Redis does not answer, the pools keep the members last read (each one's own /load
polls still take a dead member out of the rotation), and the failure is counted.
"""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from gateway.capacity.pool import Pool
from gateway.config import MembershipConfig
from workers.api.membership import CHANNEL, MemberRecord, PoolMembers, wanted_members
from workers.api.membership_store import MembershipStore

log = logging.getLogger(__name__)

P = "switchyard_gateway_membership_"
RESUBSCRIBE_S = 1.0  # a lost pub/sub connection is tried again this often (polls go on)


@dataclass(frozen=True)
class PoolChanges:
    """What reconciling one pool with a read does."""

    add: list[str]  # URLs to add as "joined"
    remove: list[tuple[str, bool]]  # (URL, lost): lost when it vanished without leaving
    refused: list[MemberRecord]  # live members of another model


def plan_changes(
    members: PoolMembers,
    joined: set[str],
    others: set[str],
    pinned: str | None = None,
    skip_announcer: str | None = None,
) -> PoolChanges:
    """Reconcile a pool whose joined members are `joined` (and whose other members,
    from config or a local supervisor, are `others`) with the read `members`. `pinned`:
    the fingerprint the config requires; `skip_announcer`: this process's own announcer
    (its members are in the pools already)."""
    wanted, refused = wanted_members(members, pinned, skip_announcer)
    present = {live.record.url for live in members.members}
    add = sorted(url for url in wanted if url not in joined and url not in others)
    remove = [(url, url not in present) for url in sorted(joined - wanted.keys())]
    return PoolChanges(add, remove, refused)


class MembershipMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.refused = Counter(
            P + "refused",
            "Announced pool members refused because their model fingerprint is not the "
            "pool's (counted once per member and fingerprint).",
            ["pool"],
            registry=registry,
        )
        self.changes = Counter(
            P + "changes",
            "Members this gateway added or removed from the fleet's Redis; change: joined, "
            "left (drained or withdrawn), lost (gone without withdrawing).",
            ["pool", "change"],
            registry=registry,
        )
        self.read_failures = Counter(
            P + "read_failures",
            "Membership reads that failed (Redis unreachable): the pools kept their members.",
            registry=registry,
        )


class MembershipWatcher:
    """Keeps the watched pools' joined members in step with the fleet's Redis. `run()`
    on the event loop until cancelled; `sync()` reads and reconciles once."""

    def __init__(
        self,
        store: MembershipStore,
        pools: dict[str, Pool],
        config: MembershipConfig,
        registry: CollectorRegistry,
        skip_announcer: str | None = None,
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        unknown = sorted(set(config.pools or ()) - set(pools))
        if unknown:
            raise ValueError(f"membership.pools names pools not configured: {unknown}")
        unknown = sorted(set(config.fingerprints) - set(pools))
        if unknown:
            raise ValueError(f"membership.fingerprints names pools not configured: {unknown}")
        if not (config.poll_s > 0 and config.ttl_s > 0):
            raise ValueError("membership.poll_s and membership.ttl_s must be > 0")
        self.store = store
        self.pools = pools
        self.config = config
        self.watched = [n for n in pools if config.pools is None or n in config.pools]
        self.metrics = MembershipMetrics(registry)
        self.skip_announcer = skip_announcer
        self.clock_ms = clock_ms  # Redis time for the reads (tests); None: the server's
        self._refused: set[tuple[str, str, str]] = set()  # (pool, member id, fingerprint)
        self._wake = asyncio.Event()
        self._failing = False
        self.subscribed = False  # to the change channel, confirmed
        self.num_syncs = 0  # reads applied, since start
        # Per pool, the model its members must have, as of the last read (None: no member).
        self.pool_fingerprints: dict[str, str | None] = {}

    @property
    def staleness_bound_s(self) -> float:
        """How long a dead member can stay in this gateway's rotation at most."""
        return self.config.ttl_s + self.config.poll_s

    async def sync(self) -> None:
        """Read the watched pools and reconcile them. Raises what Redis raises."""
        now_ms = self.clock_ms() if self.clock_ms is not None else None
        read = await self.store.read(self.watched, now_ms)
        for name, members in read.items():
            self.apply(name, members)
        self.num_syncs += 1

    def apply(self, name: str, members: PoolMembers) -> None:
        pool = self.pools[name]
        self.pool_fingerprints[name] = self.config.fingerprints.get(name) or members.fingerprint
        joined = {u for u, origin in pool.origins.items() if origin == "joined"}
        others = set(pool.views) - joined
        changes = plan_changes(
            members,
            joined,
            others,
            self.config.fingerprints.get(name),
            self.skip_announcer,
        )
        for url in changes.add:
            pool.add_member(url, origin="joined")
            self.metrics.changes.labels(name, "joined").inc()
            log.info("pool %s: %s joined (announced in the fleet's Redis)", name, url)
        for url, lost in changes.remove:
            pool.remove_member(url, lost=lost)
            self.metrics.changes.labels(name, "lost" if lost else "left").inc()
            if lost:
                log.warning("pool %s: %s is gone from the fleet (no heartbeat)", name, url)
        refused_now = set()
        for record in changes.refused:
            key = (name, record.member_id, record.fingerprint)
            refused_now.add(key)
            if key not in self._refused:
                self.metrics.refused.labels(name).inc()
                log.warning(
                    "pool %s: refused %s: its model %s (%s) is not the pool's (%s)",
                    name, record.url, record.fingerprint, record.model,
                    self.pool_fingerprints[name],
                )  # fmt: skip
        self._refused = {k for k in self._refused if k[0] != name} | refused_now
        if members.num_malformed:
            log.warning("pool %s: %d malformed member records", name, members.num_malformed)

    def wake(self) -> None:
        """Re-read now (a change message came)."""
        self._wake.set()

    async def run(self) -> None:
        listener = asyncio.ensure_future(self._listen())
        try:
            while True:
                self._wake.clear()
                await self._sync_logged()
                try:
                    async with asyncio.timeout(self.config.poll_s):
                        await self._wake.wait()
                except TimeoutError:
                    pass
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)

    async def _sync_logged(self) -> None:
        try:
            await self.sync()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (Redis unreachable: keep what we have)
            self.metrics.read_failures.inc()
            if not self._failing:
                log.warning("membership read failed (%r); pools keep their members", exc)
            self._failing = True
            return
        if self._failing:
            log.info("membership: Redis answers again")
        self._failing = False

    async def _listen(self) -> None:
        """Wake the loop on every change message; resubscribe after a lost connection."""
        watched = set(self.watched)
        while True:
            pubsub = self.store.subscribe()
            try:
                await pubsub.subscribe(CHANNEL)
                while True:
                    # A bounded wait (the client's socket timeout would end a blocking one).
                    message = await pubsub.get_message(timeout=self.config.poll_s)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        # From now on nothing is missed; what changed before, a read sees.
                        self.subscribed = True
                        self.wake()
                        continue
                    data = message.get("data")
                    pool = data.decode(errors="replace") if isinstance(data, bytes) else data
                    if message["type"] == "message" and pool in watched:
                        self.wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (the polls go on meanwhile)
                log.debug("membership channel lost (%r); resubscribing", exc)
            finally:
                self.subscribed = False
                await pubsub.aclose()
            await asyncio.sleep(RESUBSCRIBE_S)
