"""A pool of worker replicas: membership, load polling, and the pool's admission queue."""

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import httpx
import msgspec

from gateway.admission import AdmissionController, FairQueue, QueueConfig, Ticket
from gateway.balancer import WorkerView, choose_worker, has_room
from workers.api import LoadReport

log = logging.getLogger(__name__)


class Pool:
    """Replicas serving one model name; requests wait in its fair queue for room."""

    def __init__(
        self,
        name: str,
        urls: list[str],
        client: httpx.AsyncClient,
        queue_config: QueueConfig,
        max_inflight_per_worker: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.client = client
        self.views: dict[str, WorkerView] = {
            u.rstrip("/"): WorkerView(
                url=u.rstrip("/"),
                state="loading",
                num_running=0,
                num_waiting=0,
                kv_free_tokens=0,
                kv_total_tokens=0,
                inflight=0,
                max_inflight=max_inflight_per_worker,
            )
            for u in urls
        }
        self.queue_config = queue_config
        self.queue = FairQueue(queue_config, clock)
        self.clock = clock
        self._finished: deque[float] = deque(maxlen=512)  # when requests finished, for rates
        self.controller = AdmissionController(self.queue, self.has_room, clock)
        self._reported: dict[str, str] = {}

    def has_room(self) -> bool:
        return any(has_room(v) for v in self.views.values())

    def choose(self, affinity: bytes | None, exclude: set[str]) -> WorkerView | None:
        return choose_worker(list(self.views.values()), affinity, exclude)

    async def admit(self, ticket: Ticket, affinity: bytes | None) -> WorkerView | None:
        """Wait for the ticket's turn, then claim a worker in the same step (so the queue
        sees the capacity taken before it dispatches the next ticket). None: room vanished
        between dispatch and choice; the dispatcher retries."""
        await self.controller.acquire(ticket)
        view = self.choose(affinity, set())
        if view is not None:
            self.begin(view)
        return view

    def begin(self, view: WorkerView) -> None:
        view.inflight += 1

    def end(self, view: WorkerView) -> None:
        view.inflight = max(view.inflight - 1, 0)
        self._finished.append(self.clock())
        self.controller.release()

    def estimated_wait_s(self, window_s: float = 10.0) -> float:
        """Seconds a request entering the queue now would wait: the requests ahead of it
        over the recent completion rate (0 with nothing waiting, inf with no rate yet)."""
        waiting = len(self.queue)
        if waiting == 0:
            return 0.0
        now = self.clock()
        recent = sum(1 for t in self._finished if now - t <= window_s)
        if recent == 0:
            return float("inf")
        return waiting / (recent / window_s)

    def mark_unreachable(self, url: str) -> None:
        view = self.views.get(url)
        if view is not None:
            self._set_state(view, "unreachable")

    async def refresh(self) -> None:
        """Poll every member's /load once; unreachable members leave the rotation."""
        await asyncio.gather(*(self._refresh_one(v) for v in self.views.values()))
        self.controller.kick()

    async def _refresh_one(self, view: WorkerView) -> None:
        try:
            r = await self.client.get(f"{view.url}/load", timeout=1.0)
            report = (
                msgspec.json.decode(r.content, type=LoadReport) if r.status_code == 200 else None
            )
        except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError):
            report = None
        if report is None:
            state = "unreachable"
            try:
                # An OpenAI-compatible server without /load (vLLM, TGI): alive = ready.
                h = await self.client.get(f"{view.url}/health", timeout=1.0)
                state = "ready" if h.status_code == 200 else "unreachable"
            except httpx.HTTPError:
                pass
            self._set_state(view, state)
            return
        view.num_running = report.num_running
        view.num_waiting = report.num_waiting
        view.kv_free_tokens = report.kv_free_tokens
        view.kv_total_tokens = report.kv_total_tokens
        self._set_state(view, report.state)

    def _set_state(self, view: WorkerView, state: str) -> None:
        if self._reported.get(view.url) != state:
            log.info("pool %s: worker %s is %s", self.name, view.url, state)
            self._reported[view.url] = state
        view.state = state

    def snapshot(self) -> list[dict]:
        return [
            {
                "url": v.url,
                "state": v.state,
                "inflight": v.inflight,
                "running": v.num_running,
                "waiting": v.num_waiting,
                "kv_free_tokens": v.kv_free_tokens,
            }
            for v in self.views.values()
        ]
