"""Runs an LLMEngine in its own thread and streams its outputs to asyncio callers.

The HTTP event loop never runs model code: it hands requests and aborts to the engine
thread through a locked inbox, which the thread drains at each step boundary, and gets
outputs back through `call_soon_threadsafe`.
"""

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import RequestOutput
from workers.engine.request import Request
from workers.engine.stats import QueueSnapshot
from workers.errors import RequestFailedError

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped with an error; no request can make progress."""


DeathCallback = Callable[[BaseException], None]


class AsyncEngine:
    """Thread-safe front of an LLMEngine: `generate` streams, cancelling it aborts."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._new: list[Request] = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        self.last_step_time = time.monotonic()  # heartbeat, read by health checks
        self.num_steps = 0
        self._on_death: list[DeathCallback] = []

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def add_death_callback(self, callback: DeathCallback) -> None:
        """Call `callback(error)`, from the engine thread, once the loop dies (now if dead)."""
        with self._lock:
            dead = self.error
            if dead is None:
                self._on_death.append(callback)
        if dead is not None:
            callback(dead)

    def pending_aborts(self) -> int:
        """Aborts handed in and not yet applied (they are, at the next step boundary)."""
        with self._lock:
            return len(self._aborts)

    def is_idle(self) -> bool:
        with self._lock:
            pending = bool(self._new)
        return not pending and not self.engine.has_unfinished_requests()

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit a request made by `engine.make_request` and yield its outputs.

        Closing the iterator early (client gone, task cancelled) aborts the request;
        its KV blocks are free after the engine's next step boundary. Raises
        RequestFailedError when the engine failed this request alone, EngineDeadError
        when the engine loop died.
        """
        queue: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        with self._lock:
            # Checked under the lock the dying loop takes, so no stream is left unwarned.
            if self.error is not None:
                raise EngineDeadError(str(self.error))
            self._streams[rid] = (asyncio.get_running_loop(), queue)
            self._new.append(request)
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
                if not finished:
                    self._aborts.append(rid)
            if not finished:
                self._wake.set()

    def queue_snapshot(self) -> tuple[int, int]:
        """(requests waiting, their prompt tokens not yet computed), new arrivals included.

        Read without stopping the engine thread: a close, cheap estimate for admission.
        """
        with self._lock:
            pending = list(self._new)
        waiting = list(self.engine.scheduler.waiting)
        reqs = pending + waiting
        return len(reqs), sum(r.num_tokens - r.num_computed_tokens for r in reqs)

    def admission_snapshot(self) -> "QueueSnapshot":
        """The waiting line in queue order (queued first, then new arrivals) with the
        room the running batch and the KV cache have left. Read without stopping the
        engine thread: a close, cheap estimate for admission."""
        with self._lock:
            pending = list(self._new)
        sched = self.engine.scheduler
        kv = sched.kv
        reqs = list(sched.waiting) + pending
        return QueueSnapshot(
            waiting_tokens=[r.num_tokens - r.num_computed_tokens for r in reqs],
            num_running=sched.num_running,
            max_num_seqs=sched.config.max_num_seqs,
            free_kv_tokens=kv.num_free_blocks * kv.block_size,
            block_size=kv.block_size,
        )

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def fail(self, error: BaseException) -> None:
        """Declare the engine dead from outside its thread (a shard group lost a rank, say):
        streams get `error`, death callbacks run, the loop stops. Idempotent."""
        self._die(error)
        self._stop = True
        self._wake.set()

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                with self._lock:
                    new, self._new = self._new, []
                    aborts, self._aborts = self._aborts, []
                refused = [out for out in map(engine.add, new) if out is not None]
                if refused:
                    self._deliver(refused)
                for rid in aborts:
                    out = engine.abort(rid)
                    if out is not None:
                        self._deliver([out])
                if not engine.has_unfinished_requests():
                    self.last_step_time = time.monotonic()
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                self.num_steps += 1
                self.last_step_time = time.monotonic()
                self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 (report any death to every waiter)
            log.exception("engine loop died")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = exc
            streams = list(self._streams.values())
            callbacks, self._on_death = self._on_death, []
        for loop, queue in streams:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            except RuntimeError:  # that caller's event loop is gone already
                pass
        for callback in callbacks:
            callback(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop closed under its stream: abort
                with self._lock:
                    for _, out in items:
                        self._streams.pop(out.request_id, None)
                        if not out.finished:
                            self._aborts.append(out.request_id)


def _put_all(items: list) -> None:
    for queue, out in items:
        queue.put_nowait(out)
