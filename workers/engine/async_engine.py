"""Runs an LLMEngine in its own thread and streams its outputs to asyncio callers.

The HTTP event loop never runs model code: it hands requests and aborts to the engine
thread through a locked inbox, which the thread drains at each step boundary, and gets
outputs back through `call_soon_threadsafe`. Nor does it read the engine's live state:
the engine thread publishes an `EngineStats` snapshot (after adds and aborts, once a
batch is scheduled, after each step, and on each idle wait) and other threads read that.
"""

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import RequestOutput
from workers.engine.request import Request
from workers.engine.stats import EngineStats, QueueSnapshot
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
        self.num_steps = 0
        self._on_death: list[DeathCallback] = []
        # Taken from the inbox and not yet in a published snapshot (under `_lock`).
        self._adding: list[Request] = []
        # Built here before the thread starts; afterwards only the engine thread swaps it.
        self._stats = engine.stats(time.monotonic())
        # (wall clock, engine thread CPU seconds) at the last publish: where a watcher's
        # window starts when it has no older reading of its own.
        self.heartbeat: tuple[float, float] = (self._stats.time_s, 0.0)
        engine.on_scheduled = self._publish

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self._thread.start()

    def thread_cpu_s(self) -> float | None:
        """CPU seconds the engine thread has used (user + system), read from outside it:
        a thread blocked (on a lock, a queue, I/O) does not advance it, a thread computing
        a slow step does, however many processes share its cores. None: no thread, or no
        per-thread CPU clock on this platform."""
        thread = self._thread
        ident = thread.ident if thread is not None and thread.is_alive() else None
        if ident is None:
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (AttributeError, OSError):  # not POSIX, or the thread just ended
            return None

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

    @property
    def stats(self) -> EngineStats:
        """The snapshot the engine thread published last (`time_s`: its step heartbeat)."""
        return self._stats

    def published(self) -> tuple[EngineStats, list[int]]:
        """The last snapshot and, read with it, the prompt tokens of the requests handed
        in that it does not hold yet (in order): together, every request submitted."""
        with self._lock:
            stats = self._stats
            arrivals = [r.num_prompt_tokens for r in self._adding]
            arrivals += [r.num_prompt_tokens for r in self._new]
        return stats, arrivals

    def is_idle(self) -> bool:
        """No request submitted is unfinished, as of the last snapshot."""
        with self._lock:
            pending = bool(self._new or self._adding)
            stats = self._stats
        return not pending and not stats.has_unfinished

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

    def admission_snapshot(self) -> QueueSnapshot:
        """The waiting line in queue order (the snapshot's, then arrivals not in it) with
        the room the running batch and the KV cache had left: a close, cheap estimate."""
        stats, arrivals = self.published()
        return stats.queue(arrivals)

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
                    self._adding = new
                if new or aborts:
                    done = [out for out in map(engine.add, new) if out is not None]
                    done += [out for out in map(engine.abort, aborts) if out is not None]
                    self._publish(added=True)  # before delivering: callers see it done
                    if done:
                        self._deliver(done)
                if not engine.has_unfinished_requests():
                    self._publish()  # the heartbeat of an idle loop
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                self.num_steps += 1
                self._publish()
                self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 (report any death to every waiter)
            log.exception("engine loop died")
            self._die(exc)

    def _publish(self, added: bool = False) -> None:
        """Swap in a fresh snapshot (engine thread only); `added`: it now holds what was
        taken from the inbox, so arrivals stop counting those in the same lock."""
        stats = self.engine.stats(time.monotonic())
        self.heartbeat = (stats.time_s, time.thread_time())
        if added:
            with self._lock:
                self._stats = stats
                self._adding = []
        else:
            self._stats = stats

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
