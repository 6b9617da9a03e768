"""Quota maintenance of one gateway: its heartbeat, its journal, and the reservations of dead
gateways, so that what is reserved is settled exactly once even across crashes and outages.

Each gateway is an owner (`QuotaLimiter(owner_id=...)`): reserve.lua indexes every reservation
under its owner (`sy:owner:{o}:pending`), and the owner refreshes a heartbeat key
(`sy:owner:{o}`, TTL `heartbeat_ttl_s`) and its entry in `sy:owners`. Each sweep:
  1. applies the settlements of this gateway's journal (reconciles Redis missed, requests
     admitted unchecked), each once: reconcile.lua is idempotent through its markers;
  2. adopts the journals of dead processes in the same directory (their lock is free) and
     applies them, charging an unchecked request that never ended its reserved tokens;
  3. for each owner whose heartbeat has expired, settles its indexed reservations with
     sweep.lua: slot released, reserved tokens kept charged (a late reconcile of a gateway
     that was only paused still corrects them, once). Several sweepers may race; each
     reservation is settled by one. Work is O(owners + reservations of dead owners): no SCAN.
A dead gateway's slots thus free within heartbeat_ttl_s + the sweep interval.
"""

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge

from quota import keyspace
from quota.journal import ReconcileJournal, orphaned_journals
from quota.limiter import REDIS_DOWN, QuotaLimiter

__all__ = ["QuotaMaintenance", "SweepReport", "new_owner_id"]

log = logging.getLogger(__name__)

SWEEP_BATCH = 100  # index members read per round trip


def new_owner_id() -> str:
    """A fresh owner id for one gateway process (16 hex digits)."""
    return secrets.token_hex(8)


@dataclass
class SweepReport:
    """What one sweep did. Counts are settlements applied (not ones found already applied)."""

    replayed: int = 0  # from this gateway's own journal
    adopted: int = 0  # from journals of dead processes
    swept: int = 0  # reservations of dead owners settled
    redis_down: bool = False  # the sweep stopped at an unreachable Redis (retried next time)


class QuotaMaintenance:
    """Heartbeat, journal replay and dead-owner sweeps for the gateway that owns `limiter`.

    `limiter` must have an `owner_id`; its `journal` (None: nothing to replay or adopt) lives
    in the directory where dead processes' journals are adopted from.
    `heartbeat_ttl_s`: seconds without a heartbeat after which an owner counts as dead; the
    heartbeat is refreshed every third of it. No owner is swept until this gateway has seen
    Redis reachable for that long, so after an outage live owners beat again first.
    `owner_gc_s`: an owner dead this long, with nothing left indexed, leaves `sy:owners`.
    `clock`: unix seconds. `registry`: where the Prometheus metrics go (None: private).
    """

    def __init__(
        self,
        limiter: QuotaLimiter,
        *,
        heartbeat_ttl_s: float = 5.0,
        owner_gc_s: float = 3600.0,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if limiter.owner_id is None:
            raise ValueError("QuotaMaintenance needs a limiter with an owner_id")
        if heartbeat_ttl_s <= 0:
            raise ValueError("heartbeat_ttl_s must be positive")
        self.owner_id: str = limiter.owner_id
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._journal = limiter.journal
        self._scripts = limiter.scripts
        self._redis = limiter.scripts.redis
        self._owner_gc_ms = int(owner_gc_s * 1000)
        self._clock = clock
        self._up_since: float | None = None  # since when Redis has been reachable (clock)
        self._down = False  # in an outage episode (logged once)
        self._reaped: set[str] = set()  # dead owners already logged
        registry = registry if registry is not None else CollectorRegistry()
        self._applied = Counter(
            "switchyard_gateway_quota_journal_applied",
            "Journaled settlements applied to Redis, by source (own journal or adopted from a "
            "dead process)",
            ["source"],
            registry=registry,
        )
        self._swept = Counter(
            "switchyard_gateway_quota_swept",
            "Reservations of dead gateways settled by this one (slot released, reservation kept "
            "charged)",
            registry=registry,
        )
        self._sweep_errors = Counter(
            "switchyard_gateway_quota_sweep_errors",
            "Sweeps or heartbeats that met an unreachable Redis",
            registry=registry,
        )
        self._outstanding = Gauge(
            "switchyard_gateway_quota_journal_outstanding",
            "Settlements in this gateway's journal not yet applied",
            registry=registry,
        )

    async def heartbeat(self) -> bool:
        """Refresh this owner's liveness. False: Redis unreachable (counted, logged once)."""
        now_ms = int(self._clock() * 1000)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(
                    keyspace.owner_heartbeat(self.owner_id),
                    now_ms,
                    px=int(self.heartbeat_ttl_s * 1000),
                )
                pipe.zadd(keyspace.OWNERS, {self.owner_id: now_ms})
                await pipe.execute()
        except REDIS_DOWN as exc:
            self._note_down(exc)
            return False
        self._note_up()
        return True

    async def sweep(self) -> SweepReport:
        """One pass of all three duties; an unreachable Redis ends it early (see the report)."""
        report = SweepReport()
        try:
            if not await self.heartbeat():
                report.redis_down = True
                return report
            if self._journal is not None:
                report.replayed = await self._replay(self._journal, own=True)
                report.adopted = await self._adopt_orphans()
            if self._up_since is not None and self._clock() - self._up_since >= (
                self.heartbeat_ttl_s
            ):
                report.swept = await self._sweep_dead_owners()
        except REDIS_DOWN as exc:
            self._note_down(exc)
            report.redis_down = True
        finally:
            if self._journal is not None:
                self._outstanding.set(len(self._journal))
        return report

    async def run_forever(self, interval_s: float, stop_event: asyncio.Event) -> None:
        """Sweep every `interval_s` seconds and beat every heartbeat_ttl_s / 3 until
        `stop_event` is set. Fsyncs the journal each sweep, off the event loop."""
        beats = asyncio.create_task(self._beat_forever(stop_event))
        try:
            while not stop_event.is_set():
                try:
                    await self.sweep()
                    if self._journal is not None:
                        await asyncio.to_thread(self._journal.sync)
                except Exception:
                    log.exception("quota: sweep failed")
                await _wait(stop_event, interval_s)
        finally:
            beats.cancel()
            await asyncio.gather(beats, return_exceptions=True)

    async def close(self) -> None:
        """After the gateway's last reconcile: apply what the journal still holds if Redis
        allows, drop the heartbeat (so any leftover is swept at once), close the journal
        (removed if empty; otherwise the next process adopts it)."""
        try:
            if self._journal is not None:
                await self._replay(self._journal, own=True)
            await self._redis.delete(keyspace.owner_heartbeat(self.owner_id))
        except REDIS_DOWN as exc:
            self._note_down(exc)
        if self._journal is not None:
            self._journal.close(remove_if_empty=True)

    async def _beat_forever(self, stop_event: asyncio.Event) -> None:
        while not stop_event.is_set():
            await self.heartbeat()
            await _wait(stop_event, self.heartbeat_ttl_s / 3)

    async def _replay(self, journal: ReconcileJournal, *, own: bool) -> int:
        applied = 0
        for settlement in journal.outstanding():
            if own and not settlement.final:
                continue  # its request is still running here; its reconcile settles it
            if await self._scripts.settle(settlement):
                applied += 1
                self._applied.labels(source="own" if own else "adopted").inc()
            journal.done(settlement.request_id)
        return applied

    async def _adopt_orphans(self) -> int:
        assert self._journal is not None
        applied = 0
        for path in orphaned_journals(self._journal.path.parent, self._journal.path):
            orphan = ReconcileJournal.adopt(path)
            if orphan is None:
                continue  # its process is alive
            try:
                if len(orphan):
                    log.info("quota: applying %d settlements of dead journal %s", len(orphan), path)
                applied += await self._replay(orphan, own=False)
            finally:
                orphan.close(remove_if_empty=True)
        return applied

    async def _sweep_dead_owners(self) -> int:
        entries = cast(
            "list[tuple[bytes, float]]",
            await self._redis.zrange(keyspace.OWNERS, 0, -1, withscores=True),
        )
        owners = [(_text(o), int(score)) for o, score in entries if _text(o) != self.owner_id]
        if not owners:
            return 0
        async with self._redis.pipeline(transaction=False) as pipe:
            for owner, _ in owners:
                pipe.exists(keyspace.owner_heartbeat(owner))
            alive = await pipe.execute()
        swept = 0
        now_ms = int(self._clock() * 1000)
        for (owner, last_beat_ms), is_alive in zip(owners, alive, strict=True):
            if is_alive:
                self._reaped.discard(owner)
                continue
            num = await self._sweep_owner(owner)
            swept += num
            if num and owner not in self._reaped:
                self._reaped.add(owner)
                log.warning("quota: gateway %s is dead; settled %d of its reservations", owner, num)
            if last_beat_ms < now_ms - self._owner_gc_ms:
                await self._redis.zrem(keyspace.OWNERS, owner)
                self._reaped.discard(owner)
        return swept

    async def _batch(self, index: str) -> list[bytes]:
        return cast("list[bytes]", await self._redis.zrange(index, 0, SWEEP_BATCH - 1))

    async def _sweep_owner(self, owner: str) -> int:
        swept = 0
        index = keyspace.owner_pending(owner)
        while members := await self._batch(index):
            for member in members:  # sweep.lua removes each member, so this ends
                if await self._scripts.sweep(owner, _text(member)):
                    swept += 1
                    self._swept.inc()
        return swept

    def _note_down(self, exc: Exception) -> None:
        self._sweep_errors.inc()
        self._up_since = None
        if not self._down:
            self._down = True
            log.warning("quota: sweeper cannot reach Redis (%r); settlements wait", exc)

    def _note_up(self) -> None:
        if self._up_since is None:
            self._up_since = self._clock()
        if self._down:
            self._down = False
            log.info("quota: sweeper reaches Redis again")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        pass
