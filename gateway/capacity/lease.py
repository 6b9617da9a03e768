"""A request's hold on a pool, from admission to completion: one owner for the queue turn
and the worker slot.

A `Lease` is the only thing in the gateway that takes or gives back a pool's capacity:
its turn in the pool's fair queue (`AdmissionController`) and one in-flight slot on a
worker (`WorkerView.inflight`). Moving to another replica on a retry and recording a
completion only for a request that was served are its methods, so the accounting cannot
drift apart in the request flow's branches.

States: new -> queued -> granted (holds the turn, and a worker slot when one had room)
-> released. `release` is idempotent and safe from a cancelled task (it never awaits).
"""

import asyncio
from collections.abc import Collection

from gateway.capacity.balancer import WorkerView
from gateway.capacity.fair_queue import Ticket
from gateway.capacity.pool import Pool
from gateway.capacity.refusals import DeadlineExceeded, NoReplica, OverCapacity, QueueFull

__all__ = ["Lease", "NoReplica"]


class Lease:
    """One request's queue turn and worker slot in one pool."""

    __slots__ = (
        "pool",
        "ticket",
        "affinity",
        "worker",
        "tried",
        "_future",
        "_state",
        "_granted_at",
    )

    def __init__(self, pool: Pool, ticket: Ticket, affinity: bytes | None) -> None:
        self.pool = pool
        self.ticket = ticket
        self.affinity = affinity
        self.worker: WorkerView | None = None  # the slot held now, if any
        self.tried: set[str] = set()  # worker URLs this request was sent to
        self._future: asyncio.Future[None] | None = None
        self._state = "new"
        self._granted_at = 0.0

    @property
    def granted(self) -> bool:
        return self._state == "granted"

    def enqueue(self) -> None:
        """Join the pool's fair queue. Raises OverCapacity (predicted to miss its TTFT
        target), QueueFull, DeadlineExceeded or (no live replica in the pool) NoReplica
        at once, before any response has started, so the
        client gets the real status."""
        assert self._state == "new"
        self.pool.record_arrival()
        try:
            self.pool.admit(self.ticket)
            self._future = self.pool.controller.enqueue(self.ticket)
        except (OverCapacity, QueueFull, DeadlineExceeded, NoReplica) as exc:
            self.pool.count_refusal(exc)
            raise
        if self._future is None:
            self._grant()
        else:
            self._state = "queued"

    async def wait(self) -> None:
        """Wait for the turn (no-op when granted at once). Raises DeadlineExceeded when the
        deadline passes in the queue; cancelling the wait leaves the queue."""
        if self._state == "queued":
            assert self._future is not None
            self._state = "waiting"
            try:
                await self.pool.controller.wait(self.ticket, self._future)
            except (OverCapacity, QueueFull, DeadlineExceeded, NoReplica) as exc:
                self._state = "released"  # the controller already took the ticket out
                self.pool.count_refusal(exc)
                raise
            except BaseException:
                self._state = "released"
                raise
            if self._state == "released":  # released by its owner while the turn came
                self.pool.controller.release(self.ticket)
                raise asyncio.CancelledError
            self._grant()
        if self._state != "granted":
            raise RuntimeError(f"lease of {self.ticket.request_id} is {self._state}")

    def _grant(self) -> None:
        # Take a slot in the same step as the turn, so the queue sees the capacity taken
        # before it dispatches the next ticket. None: room vanished; `next_worker` retries.
        self._state = "granted"
        self._granted_at = self.pool.clock()
        self.worker = self.pool.claim_slot(self.affinity, (), self.ticket)

    def next_worker(self) -> WorkerView:
        """The worker for the next try: the one claimed at admission on the first try, then
        another replica (one not tried yet, else any with room), moving the slot there.
        Raises NoReplica when none has room."""
        assert self._state == "granted"
        view = self.worker
        if view is None or view.url in self.tried:
            if view is not None:
                self.pool.free_slot(view, self.ticket)
                self.worker = None
            view = self._claim(self.tried) or self._claim(())
            if view is None:
                raise NoReplica(self.pool.name)
            self.worker = view
        self.tried.add(view.url)
        return view

    def _claim(self, exclude: Collection[str]) -> WorkerView | None:
        return self.pool.claim_slot(self.affinity, exclude, self.ticket)

    def release(self, served: bool) -> None:
        """Give back the slot and the turn (or leave the queue). `served`: a worker answered
        the request (the completion counts toward the pool's rate); refusals, failures and
        requests that never reached a worker do not. Idempotent."""
        state, self._state = self._state, "released"
        if state == "queued":
            assert self._future is not None
            self.pool.controller.abandon(self.ticket, self._future)
        elif state == "granted":
            if self.worker is not None:
                self.pool.free_slot(self.worker, self.ticket)
                self.worker = None
            if served:
                self.pool.record_completion(self.pool.clock() - self._granted_at)
            self.pool.controller.release(self.ticket)
        # "waiting": the cancelled wait already left the queue; "new"/"released": nothing.
