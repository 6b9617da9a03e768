"""Where work that grows with a request's size runs: on threads, fairly by tenant, never on
the event loop.

Counting a prompt (rendering a chat template, tokenizing) costs time in proportion to its
bytes. On the event loop one big prompt stalls every other request; on a shared pool in
arrival order, one tenant's big prompts queue in front of everyone's. `CountingPool` runs
it on `num_threads` threads, at most `per_tenant` of one tenant's at a time: a tenant's
next ones wait in its own lane, and the lanes are served round-robin as threads free. So a
tenant's counting competes only with its own, whatever it sends.
"""

import asyncio
import concurrent.futures
import random
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from workers.api.types import ApiError

T = TypeVar("T")


class CountingPool:
    """Threads for size-bound work, shared fairly by tenant.

    `run(tenant, fn)` returns `fn()`'s value (or raises its exception), computed on a
    thread once `tenant` has fewer than `per_tenant` running and a thread is free. Up to
    `lane_max` of a tenant's wait for that; one more is refused at once (429
    `gateway_busy`). A caller that leaves stops waiting, but work already on a thread keeps
    its thread and its tenant's place until it ends: leaving cannot run more at once.
    """

    def __init__(
        self,
        num_threads: int = 2,
        per_tenant: int = 1,
        lane_max: int = 64,
        rng: random.Random | None = None,
    ) -> None:
        if num_threads < 1 or per_tenant < 1 or lane_max < 0:
            raise ValueError("need num_threads >= 1, per_tenant >= 1, lane_max >= 0")
        self.num_threads, self.per_tenant, self.lane_max = num_threads, per_tenant, lane_max
        self._rng = rng or random.Random()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            num_threads, thread_name_prefix="prompt-count"
        )
        self.running: dict[str, int] = {}  # per tenant: work on a thread, not yet ended
        self._num_running = 0
        # Tenants with waiters, in round-robin order; a waiter's future is set when its
        # work may start (its place already taken for it).
        self._lanes: dict[str, deque[asyncio.Future[None]]] = {}

    @property
    def waiting(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    async def run(self, tenant: str, fn: Callable[[], T]) -> T:
        if tenant in self._lanes or not self._may_start(tenant):
            await self._wait_turn(tenant)
        else:
            self._start(tenant)
        loop = asyncio.get_running_loop()
        try:
            job = self._executor.submit(fn)
        except BaseException:
            self._end(tenant)
            raise
        job.add_done_callback(lambda _: _call_soon(loop, self._end, tenant))
        return await asyncio.wrap_future(job)

    def close(self) -> None:
        """Stop the threads once their work ends (nothing new is accepted)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _may_start(self, tenant: str) -> bool:
        free = self._num_running < self.num_threads
        return free and self.running.get(tenant, 0) < self.per_tenant

    def _start(self, tenant: str) -> None:
        self._num_running += 1
        self.running[tenant] = self.running.get(tenant, 0) + 1

    def _end(self, tenant: str) -> None:
        self._num_running -= 1
        left = self.running[tenant] - 1
        if left:
            self.running[tenant] = left
        else:
            del self.running[tenant]
        self._serve_lanes()

    async def _wait_turn(self, tenant: str) -> None:
        if len(self._lanes.get(tenant, ())) >= self.lane_max:
            raise ApiError(
                429,
                "this tenant has too many large prompts waiting to be counted; retry after "
                "the Retry-After interval",
                type="rate_limit_error",
                code="gateway_busy",
                retry_after_s=1.0 + self._rng.random(),
            )
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lanes.setdefault(tenant, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._end(tenant)  # its turn came as its caller left: give the place back
            else:
                self._leave_lane(tenant, turn)
            raise

    def _leave_lane(self, tenant: str, turn: "asyncio.Future[None]") -> None:
        lane = self._lanes.get(tenant)
        if lane is not None and turn in lane:
            lane.remove(turn)
            if not lane:
                del self._lanes[tenant]

    def _serve_lanes(self) -> None:
        """Round-robin over the lanes, one waiter per tenant per round, while a thread is
        free and some tenant with waiters is under `per_tenant`."""
        started = True
        while started:
            started = False
            for tenant in list(self._lanes):
                if self._num_running >= self.num_threads:
                    return
                lane = self._lanes[tenant]
                while lane and lane[0].done():  # cancelled, its task not resumed yet
                    lane.popleft()
                if lane and self.running.get(tenant, 0) < self.per_tenant:
                    self._start(tenant)
                    lane.popleft().set_result(None)
                    started = True
                    del self._lanes[tenant]
                    if lane:
                        self._lanes[tenant] = lane  # served: to the back of the round
                elif not lane:
                    del self._lanes[tenant]


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[str], None], arg: str) -> None:
    """`fn(arg)` on `loop`, from a worker thread; nothing once the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the loop closed (shutdown) while the work ran
        pass
