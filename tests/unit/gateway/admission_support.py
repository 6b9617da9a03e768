"""What the admission tests share: a fake clock, tickets, a capacity stand-in, a
request that holds a slot, and controllers built over them."""

import asyncio
import math
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

from gateway.capacity.admission import AdmissionController
from gateway.capacity.fair_queue import FairQueue, QueueConfig, Ticket


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_queue(clock: FakeClock | None = None, seed: int = 0, **config: float) -> FairQueue:
    config.setdefault("quantum_tokens", 4096)  # these tests' tickets cost 1000 by default
    return FairQueue(QueueConfig(**config), clock or FakeClock(), random.Random(seed))  # type: ignore[arg-type]


def make_ticket(
    request_id: str,
    tenant_id: str | None = None,
    cost_tokens: int = 1000,
    deadline: float = math.inf,
    weight: float = 1.0,
) -> Ticket:
    tenant = tenant_id if tenant_id is not None else request_id[0]
    return Ticket(request_id, tenant, cost_tokens, 0.0, deadline, weight)


def pop_all(queue: FairQueue) -> list[str]:
    out = []
    while True:
        ticket, _ = queue.pop()
        if ticket is None:
            return out
        out.append(ticket.request_id)


class Pool:
    """Capacity as a gateway sees it: requests in flight against a cap."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.inflight = 0
        self.max_seen = 0

    def has_room(self) -> bool:
        return self.inflight < self.capacity

    def take(self) -> None:
        self.inflight += 1
        self.max_seen = max(self.max_seen, self.inflight)

    def give_back(self) -> None:
        self.inflight -= 1


def run(main: Coroutine[Any, Any, None]) -> None:
    """asyncio.run with a guard, so a regression fails fast instead of hanging."""
    asyncio.run(asyncio.wait_for(main, timeout=2.0))


def make_controller(
    capacity: int, clock: Callable[[], float] = time.monotonic, **config: float
) -> tuple[AdmissionController, Pool]:
    pool = Pool(capacity)
    queue = FairQueue(QueueConfig(**config), clock, random.Random(0))  # type: ignore[arg-type]
    return AdmissionController(queue, pool.has_room, clock), pool


async def serve(
    ctl: AdmissionController,
    pool: Pool,
    ticket: Ticket,
    order: list[str],
    hold: asyncio.Event | int = 2,
) -> None:
    """A gateway request: wait for admission, take capacity, hold it, give it back."""
    await ctl.acquire(ticket)
    pool.take()
    order.append(ticket.request_id)
    if isinstance(hold, asyncio.Event):
        await hold.wait()
    else:
        for _ in range(hold):
            await asyncio.sleep(0)
    pool.give_back()
    ctl.release(ticket)


def make_reserving_controller(capacity: int, **config: float) -> tuple[AdmissionController, Pool]:
    pool = Pool(capacity)
    queue = FairQueue(QueueConfig(**config), time.monotonic, random.Random(0))  # type: ignore[arg-type]

    def slots() -> tuple[int, int]:
        return max(0, pool.capacity - pool.inflight), pool.capacity

    return AdmissionController(queue, pool.has_room, time.monotonic, slots), pool
