"""The announcing side of fleet membership (`workers.api.membership`): keeps this
process's pool members alive in Redis.

A `switchyard worker --join` process announces itself; a `switchyard serve` supervisor
announces its local replicas (`cli/serve/announce.py`). Each member is a function that
describes it now (`describe() -> MemberRecord`): its state and capacity are read afresh
at every heartbeat, and a change of state is published at once (`kick`).
"""

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from workers.api.membership import DEFAULT_TTL_S, MemberRecord, process_identity
from workers.api.membership_store import MembershipStore

log = logging.getLogger(__name__)

Describe = Callable[[], MemberRecord]


def default_host_id() -> str:
    return socket.gethostname()


def new_announcer_id(host_id: str) -> str:
    """This process among the fleet's announcers (`process_identity`)."""
    return process_identity(host_id)


def local_devices(device: str) -> list[str]:
    """The devices a worker on `device` ("cpu", "cuda", "cuda:N") runs on, as announced:
    the GPUs it sees, or the CPU cores it may run on."""
    if device.startswith("cuda"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = device.partition(":")[2] or "0"
        if visible is not None:
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            return [f"cuda:{ids[int(index)]}"] if int(index) < len(ids) else []
        return [f"cuda:{index}"]
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = list(range(os.cpu_count() or 1))
    return [f"cpu:{c}" for c in cores]


@dataclass
class _Member:
    describe: Describe
    last_state: str | None = None  # as last announced; None: not announced yet
    refused: bool = False  # its model is not the pool's (logged once)


class Announcer:
    """Heartbeats every member every `ttl_s / 3` (sooner after `kick`), each with a
    deadline `ttl_s` ahead; `withdraw` leaves a member's tombstone. Run `start()` on the
    event loop and `close()` before exiting (it withdraws every member)."""

    def __init__(
        self,
        store: MembershipStore,
        ttl_s: float = DEFAULT_TTL_S,
        announcer_id: str | None = None,
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"the membership TTL must be > 0 s, got {ttl_s}")
        self.store = store
        self.ttl_s = ttl_s
        self.announcer_id = announcer_id or new_announcer_id(default_host_id())
        # Now in ms for the scripts (tests); None: the Redis server's clock.
        self.clock_ms = clock_ms
        self.members: dict[tuple[str, str], _Member] = {}
        self._wake = asyncio.Event()
        # One announcement at a time: a heartbeat landing after a withdrawal would bring
        # the member back for a TTL.
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._failing = False  # Redis did not answer the last heartbeat (logged once)

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 3

    def add(self, describe: Describe) -> tuple[str, str]:
        """Announce the member `describe` describes from the next heartbeat on (`kick`ed:
        at once). Returns its (pool, member id)."""
        record = describe()
        key = (record.pool, record.member_id)
        self.members[key] = _Member(describe)
        self.kick()
        return key

    def kick(self) -> None:
        """Heartbeat now: a member's state changed."""
        self._wake.set()

    async def heartbeat(self) -> None:
        """Announce every member once, as it describes itself now. Raises what Redis
        raises; a member whose model is not its pool's is logged, once."""
        for key in list(self.members):
            async with self._lock:
                member = self.members.get(key)
                if member is None:
                    continue  # withdrawn meanwhile
                record = self._stamped(member.describe())
                changed = record.state != member.last_state
                reply = await self.store.announce(record, self.ttl_s, changed, self._now_ms())
                member.last_state = record.state
            if not reply.matches and not member.refused:
                log.error(
                    "pool %s serves model %s; %s (%s, model %s) is refused by every gateway",
                    record.pool, reply.pool_fingerprint, record.url, record.model,
                    record.fingerprint,
                )  # fmt: skip
            member.refused = not reply.matches

    async def withdraw(self, pool: str, member_id: str) -> None:
        """Stop announcing the member and leave its tombstone (`state: withdrawn`): every
        gateway takes it out of its rotation at once, its requests finishing."""
        async with self._lock:
            member = self.members.pop((pool, member_id), None)
            if member is None:
                return
            record = self._stamped(member.describe())
            record = msgspec.structs.replace(record, state="withdrawn")
            await self.store.announce(record, self.ttl_s, True, self._now_ms())
        log.info("pool %s: withdrew %s", pool, record.url)

    async def withdraw_all(self, timeout_s: float = 2.0) -> None:
        """Withdraw every member, giving up after `timeout_s` (Redis unreachable: the
        members expire within the TTL instead)."""
        keys = list(self.members)
        try:
            async with asyncio.timeout(timeout_s):
                for pool, member_id in keys:
                    await self.withdraw(pool, member_id)
        except Exception as exc:  # noqa: BLE001 (on the way out: say so, do not raise)
            log.warning("could not withdraw from the fleet (%r); gone within %g s", exc, self.ttl_s)
            self.members.clear()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self.run())

    async def run(self) -> None:
        """Heartbeat forever; a failed one is retried sooner, and logged once per outage."""
        while True:
            self._wake.clear()
            delay = self.interval_s
            try:
                await self.heartbeat()
                if self._failing:
                    log.info("membership: Redis answers again")
                self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (an outage: keep trying)
                if not self._failing:
                    log.warning("membership heartbeat failed (%r); retrying", exc)
                self._failing = True
                delay = min(delay, 0.5)
            try:
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def close(self, timeout_s: float = 2.0) -> None:
        """Stop heartbeating and withdraw every member. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.withdraw_all(timeout_s)

    def _stamped(self, record: MemberRecord) -> MemberRecord:
        if record.announcer == self.announcer_id:
            return record
        return msgspec.structs.replace(record, announcer=self.announcer_id)

    def _now_ms(self) -> int | None:
        return None if self.clock_ms is None else self.clock_ms()


def started_at() -> float:
    """Unix seconds now, for a member's `started_at`."""
    return time.time()
