"""A pool of worker replicas: membership, load polling, and the pool's admission queue."""

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping

from gateway.capacity.admission import AdmissionController
from gateway.capacity.balancer import WorkerView, choose_worker, has_room, is_live, seats_share
from gateway.capacity.fair_queue import FairQueue, QueueConfig, Ticket
from gateway.capacity.flaps import FlapGuard, FlapPolicy
from gateway.capacity.foreign import ForeignMembers
from gateway.capacity.goodput import Goodput
from gateway.capacity.predictor import (
    NEVER,
    Prediction,
    ReplicaCapacity,
    Work,
    predict,
    retry_after_s,
)
from gateway.capacity.provider import ProviderLimited, ProviderLimits
from gateway.capacity.refusals import DeadlineExceeded, OverCapacity, QueueFull
from workers.api.client import WorkerClient

log = logging.getLogger(__name__)


_LOST_STATES = ("unreachable", "stalled")  # a request waiting on such a worker retries
TTFT_BIAS_ALPHA = 0.1  # weight of each admitted stream's TTFT prediction error


class Pool:
    """Replicas serving one model name; requests wait in its fair queue for room."""

    def __init__(
        self,
        name: str,
        urls: list[str],
        client: WorkerClient,
        queue_config: QueueConfig,
        max_inflight_per_worker: int,
        clock: Callable[[], float] = time.monotonic,
        start_grace_s: float = 30.0,
        ttft_target_s: float | None = None,
        seat_share: float = 1.0,
        start_estimate_s: float = 30.0,
        priority_ttft_scale: dict[int, float] | None = None,
        flap_policy: FlapPolicy | None = None,
        kind: str = "switchyard",
        upstream_model: str | None = None,
        max_concurrency: int | None = None,
        context_length: int | None = None,
        upstream_headers: dict[str, str] | None = None,
        foreign_probe_interval_s: float = 1.0,
        tokens_per_minute: int | None = None,
        ttft_headroom: float = 0.0,
    ) -> None:
        self.name = name
        # Sent with every request to a member (the upstream's API key); never logged.
        self._upstream_headers = upstream_headers or {}
        # The kind of server its members are (workers.api.upstreams); "auto": each member's
        # is detected on its first poll, and the pool takes the first one found.
        self.kind = kind
        self.upstream_model = upstream_model  # the model name its servers serve; None: ours
        # A foreign member's concurrency when configured (else what it says, else the cap)
        # and context length when it does not say.
        self.max_concurrency = max_concurrency
        self.context_length = context_length
        # Members of other kinds: probed through their adapters, measured from the answers
        # relayed (foreign.py).
        self.foreign = ForeignMembers(self, foreign_probe_interval_s)
        # A hosted pool's provider limits (its budget, and its x-ratelimit-* word): None for
        # servers of our own and of the operator's, which refuse per replica.
        self.provider = (
            ProviderLimits(tokens_per_minute, clock, seat_share)
            if kind == "openai" or tokens_per_minute is not None
            else None
        )
        # A member back from a stall rejoins the rotation only after a hold (flaps.py).
        self.flaps = FlapGuard(flap_policy or FlapPolicy())
        # Admission against the target (`admit`); None: counts and deadlines only.
        self.ttft_target_s = ttft_target_s
        self.priority_ttft_scale = priority_ttft_scale or {0: 1.0}
        # The share of each target admission keeps back for what no model predicts (a
        # burst's clients and relays sharing the cores): it aims at target x (1 - this).
        self.ttft_headroom = ttft_headroom
        # This gateway process's share of each replica's seats (1/N of a group of N).
        self.seat_share = seat_share
        # How long a replica takes from joining to ready, until one was measured.
        self.start_estimate_s = start_estimate_s
        self._start_times: deque[float] = deque(maxlen=16)  # measured: joined -> ready
        # Output tokens generated per max_tokens allowed, over recent requests (EWMA);
        # 1.0 (every request runs to its max_tokens) until measured.
        self.completion_ratio = 1.0
        self.last_prediction: Prediction | None = None  # of the last request admitted
        # The mean error of admitted streams' TTFT predictions (EWMA, `record_ttft`);
        # admission adds it where it is positive.
        self.ttft_bias_s = 0.0
        self.refusals: dict[str, int] = {}  # by reason, since start
        self.goodput = Goodput()  # requests served, and those within their targets
        self.client = client
        self.max_inflight_per_worker = max_inflight_per_worker
        self.clock = clock
        # A member silent since it joined is starting, not lost, for this long.
        self.start_grace_s = start_grace_s
        self.views: dict[str, WorkerView] = {}
        # Where each member came from: "config" (static urls), "local" (a supervisor in
        # this process), "joined" (announced in the fleet's Redis: gateway/capacity/membership.py).
        self.origins: dict[str, str] = {}
        for u in urls:
            self.add_member(u)
        self.queue_config = queue_config
        self.queue = FairQueue(queue_config, clock)
        self._finished: deque[float] = deque(maxlen=512)  # when requests finished, for rates
        self._arrivals: deque[float] = deque(maxlen=4096)  # when requests were offered
        self._service: deque[tuple[float, float]] = deque(maxlen=512)  # (finished, held s)
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=512)  # (when, TTFT s)
        self._tokens: deque[tuple[float, int]] = deque(maxlen=4096)  # (settled, tokens out)
        self.controller = AdmissionController(
            self.queue, self.has_room, clock, self.slots, live=self.has_live_replica, name=name
        )
        self._reported: dict[str, str] = {}
        self._lost: dict[str, asyncio.Future[None]] = {}

    def add_member(self, url: str, origin: str = "config") -> None:
        """A replica joins (a supervisor started it, or it was announced, `origin`):
        `loading` until its /load says ready. A member already there keeps its view; a
        member from config or a local supervisor keeps that origin over "joined"."""
        url = url.rstrip("/")
        if origin != "joined" or self.origins.get(url, "joined") == "joined":
            self.origins[url] = origin
        if url not in self.views:
            if self._upstream_headers:
                self.client.set_headers(url, self._upstream_headers)
            self.views[url] = WorkerView(
                url=url,
                state="loading",
                num_running=0,
                num_waiting=0,
                kv_free_tokens=0,
                kv_total_tokens=0,
                inflight=0,
                max_inflight=self.max_inflight_per_worker,
                joined_at=self.clock(),
                kind=self.kind,
            )

    def remove_member(self, url: str, lost: bool = False) -> None:
        """A replica leaves the rotation. `lost`: it died; requests waiting on its answer
        stop waiting (their leases still hold the view and give its slot back)."""
        url = url.rstrip("/")
        if lost:
            self.mark_unreachable(url)
        self.origins.pop(url, None)
        if self.views.pop(url, None) is not None:
            log.info("pool %s: worker %s left", self.name, url)
            if self._upstream_headers:
                self.client.set_headers(url, {})
        self._reported.pop(url, None)
        self._lost.pop(url, None)
        self.foreign.forget(url)
        self.flaps.forget(url)

    def record_arrival(self) -> None:
        """A request was offered to the pool (queued or refused): the arrival rate."""
        self._arrivals.append(self.clock())

    def rates(self, window_s: float = 10.0) -> tuple[float, float | None]:
        """(arrivals per second over the last `window_s`, mean seconds a served request held
        a worker slot). The mean is over the window's completions, else the last 32 (a
        quiet pool keeps its service time); None until a request was served."""
        now = self.clock()
        arrivals = sum(1 for t in self._arrivals if now - t <= window_s)
        held = [s for t, s in self._service if now - t <= window_s]
        held = held or [s for _, s in list(self._service)[-32:]]
        return arrivals / window_s, (sum(held) / len(held) if held else None)

    def record_ttft(self, seconds: float, ticket: Ticket | None = None) -> None:
        """A stream's first token reached its client `seconds` after arrival. With the
        `ticket` it was admitted on, the prediction's error is learned: `ttft_bias_s`, what
        the model leaves out (relaying, a busy event loop), added to later predictions."""
        now = self.clock()
        self._ttfts.append((now, seconds))
        if ticket is not None and ticket.predicted_ttft_s is not None:
            arrived = ticket.enqueued_at if ticket.arrived_at is None else ticket.arrived_at
            error = (now - arrived) - ticket.predicted_ttft_s
            self.ttft_bias_s += TTFT_BIAS_ALPHA * (error - self.ttft_bias_s)

    def ttft_quantile_s(self, q: float, window_s: float = 60.0) -> float | None:
        """The `q` quantile (0..1) of streams' TTFT over the last `window_s`; None: none."""
        now = self.clock()
        recent = sorted(s for t, s in self._ttfts if now - t <= window_s)
        return recent[min(len(recent) - 1, int(q * len(recent)))] if recent else None

    def record_tokens(self, num_tokens: int, max_tokens: int | None = None) -> None:
        """A settled request's completion tokens, for the pool's tokens per second; with
        `max_tokens` (what it was allowed), the completion ratio admission expects."""
        self._tokens.append((self.clock(), num_tokens))
        if max_tokens:
            ratio = min(1.0, num_tokens / max_tokens)
            self.completion_ratio += 0.05 * (ratio - self.completion_ratio)

    # -- admission against the TTFT target ------------------------------------------

    def capacity(self, typical: Work) -> list[ReplicaCapacity] | None:
        """Every live replica's capacity as admission reasons over it (`predictor`); None
        while a live one reports no capacity model (still learning, or an external
        server): then nothing is predicted and only the target's start bound holds. Our
        requests in flight that a replica's last report does not show yet are counted as
        holding a seat for as long as `typical` would."""
        now = self.clock()
        ratio = self.completion_ratio
        out: list[ReplicaCapacity] = []
        starting = [v for v in self.views.values() if v.state == "loading" or _starting(v)]
        for v in self.views.values():
            if v.state != "ready":
                continue
            if v.seats is None or not v.decode_step_s or not v.prefill_tokens_per_s:
                return None
            step, rate = v.decode_step_s, v.prefill_tokens_per_s
            backlog = (v.running_prefill_tokens + v.queued_prompt_tokens) / rate
            occupied = [n * ratio * step for n in v.running_remaining]
            # Its waiting line (prefilled by the end of the backlog at the latest), and
            # ours not in its last report, hold seats too.
            occupied += [backlog + n * ratio * step for n in v.waiting_max_tokens]
            # A foreign server reports counts, not work: what it runs and queues beyond our
            # requests there (other clients') holds seats too.
            held = v.inflight
            if v.kind != "switchyard":
                held = max(held, v.num_running + v.num_waiting)
            unseen = held - len(occupied)
            if unseen > 0:
                # Ours sent since its last report, by their own sizes (a burst of long
                # prompts is a long prefill line); others' at the typical size. Each is
                # prefilled after the line before it, then decodes.
                sizes: list[tuple[int, float]] = [
                    (prompt, max_tokens * ratio)
                    for prompt, max_tokens in list(v.sent.values())[-unseen:]
                ]
                sizes += [(typical.prompt_tokens, typical.output_tokens)] * (unseen - len(sizes))
                for prompt, output in sizes:
                    backlog += prompt / rate
                    occupied.append(backlog + output * step)
            out.append(ReplicaCapacity(v.seats, tuple(occupied), step, rate, 0.0, backlog))
        if not out:
            return None
        template = out[0]
        for v in starting:
            ready_in = max(0.0, self._start_s() - (now - v.joined_at))
            out.append(
                ReplicaCapacity(
                    template.seats,
                    (),
                    template.decode_step_s,
                    template.prefill_tokens_per_s,
                    ready_in_s=max(ready_in, 0.001),
                )
            )
        return out

    def ttft_target_for(self, priority: int) -> float:
        """The TTFT target of a request of `priority` (inf: none): the pool's, scaled by
        its class (a priority outside the classes takes the nearest one's)."""
        if self.ttft_target_s is None:
            return math.inf
        scales = self.priority_ttft_scale
        nearest = min(scales, key=lambda p: (abs(p - priority), p))
        return self.ttft_target_s * scales[nearest]

    def _start_s(self) -> float:
        times = self._start_times
        return sorted(times)[len(times) // 2] if times else self.start_estimate_s

    def predict(self, ticket: Ticket) -> Prediction:
        """When `ticket` would get its first token if queued now (`predictor.predict`)."""
        ratio = self.completion_ratio
        own = Work(ticket.prompt_tokens, ticket.max_tokens * ratio)
        replicas = self.capacity(own)
        if replicas is None:
            return NEVER
        ahead = [
            Work(t.prompt_tokens, t.max_tokens * ratio)
            for t in self.queue.ahead_of(ticket.tenant_id)
        ]
        return predict(replicas, ahead, own)

    def admit(self, ticket: Ticket) -> None:
        """Refuse `ticket` now (OverCapacity) when it is predicted to miss its TTFT target
        (`Ticket.ttft_target_s`: the pool's, or its priority class's); else bound its wait
        in the queue to the latest start that still meets the target (`Ticket.start_by`).
        Without a target nothing changes; without a capacity model the start bound alone
        holds. A hosted pool refuses first what its provider would (ProviderLimited), and
        counts what it admits against the provider's budget."""
        provider = self.provider
        tokens = ticket.prompt_tokens + ticket.max_tokens
        if provider is not None:
            wait, why = provider.wait_s(tokens)
            if wait > 0:
                raise ProviderLimited(self.name, why, wait + self.queue.jitter())
        self._admit_by_target(ticket)
        if provider is not None:
            provider.charge(tokens)

    def note_answer(self, url: str, status: int, headers: Mapping[str, str]) -> None:
        """A foreign member's answer head: what it says of its provider's limits."""
        if self.provider is not None and url in self.views:
            self.provider.note_answer(status, headers)

    def _aim_s(self, target_s: float) -> float:
        """What admission aims a prediction at for `target_s`: the target less its headroom."""
        return target_s * (1.0 - self.ttft_headroom)

    def _admit_by_target(self, ticket: Ticket) -> None:
        if not math.isfinite(ticket.ttft_target_s):
            return
        target_s = self._aim_s(ticket.ttft_target_s)
        prediction = self.predict(ticket)
        self.last_prediction = prediction
        arrived = ticket.enqueued_at if ticket.arrived_at is None else ticket.arrived_at
        # Already spent before the queue, and what the model is measured to leave out.
        spent = max(0.0, ticket.enqueued_at - arrived) + max(0.0, self.ttft_bias_s)
        if prediction.known and spent + prediction.ttft_s > target_s:
            cfg = self.queue_config
            wait = retry_after_s(prediction, target_s - spent, cfg.retry_after_s, 30.0)
            wait += self.queue.jitter()
            raise OverCapacity(
                self.name, spent + prediction.ttft_s, ticket.ttft_target_s, wait,
                self.ttft_headroom,
            )  # fmt: skip
        if prediction.known:
            ticket.predicted_ttft_s = ticket.enqueued_at - arrived + prediction.ttft_s
        own = prediction.first_token_s + max(0.0, self.ttft_bias_s) if prediction.known else 0.0
        ticket.start_by = arrived + max(0.0, target_s - own)

    def would_miss(
        self, tenant_id: str, prompt_tokens: int, max_tokens: int, priority: int
    ) -> bool:
        """Whether a request of this size would be refused for its TTFT target now (the
        cascade overflows such a request to the small pool instead)."""
        target = self.ttft_target_for(priority)
        if not math.isfinite(target):
            return False
        probe = Ticket("probe", tenant_id, prompt_tokens + max_tokens, self.clock(), math.inf,
                       prompt_tokens=prompt_tokens, max_tokens=max_tokens)  # fmt: skip
        prediction = self.predict(probe)
        return prediction.known and prediction.ttft_s > self._aim_s(target)

    def count_refusal(self, error: Exception) -> None:
        """A request refused before any token (by the Lease), counted by reason."""
        reason = refusal_reason(error)
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    @property
    def itl_target_s(self) -> float | None:
        """The ITL target its workers report in /load (the strictest, of those that still
        are members); None: none reports one."""
        reported = [v.itl_target_s for v in self.views.values() if v.itl_target_s is not None]
        targets = [t for t in reported if 0.0 < t < math.inf]
        return min(targets) if targets else None

    def typical_ttft_s(self) -> float | None:
        """Seconds until a typical request (`goodput.typical()`) of a tenant with nothing
        waiting would get its first token if it arrived now, as admission predicts it
        (`predict`); None without a capacity model or a replica."""
        prompt, max_tokens = self.goodput.typical()
        probe = Ticket("typical", "", prompt + max_tokens, self.clock(), math.inf,
                       prompt_tokens=prompt, max_tokens=max_tokens)  # fmt: skip
        prediction = self.predict(probe)
        return prediction.ttft_s if prediction.known else None

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        """Completion tokens of requests settled in the last `window_s`, per second."""
        now = self.clock()
        return sum(n for t, n in self._tokens if now - t <= window_s) / window_s

    def ttft_p90_s(self, window_s: float = 10.0) -> float | None:
        """The 90th percentile of streams' time to first token over the last `window_s`
        (arrival to first token, queue included); None without a stream in the window."""
        now = self.clock()
        recent = sorted(s for t, s in self._ttfts if now - t <= window_s)
        if not recent:
            return None
        return recent[min(len(recent) - 1, int(0.9 * len(recent)))]

    def has_room(self) -> bool:
        return any(has_room(v) for v in self.views.values())

    def has_live_replica(self) -> bool:
        """Whether a member serves or soon will (`balancer.is_live`); False: requests are
        refused at once rather than queued for a replica that is not coming."""
        now = self.clock()
        return any(is_live(v, now, self.start_grace_s) for v in self.views.values())

    def slots(self) -> tuple[int, int]:
        """(free, total) in-flight slots of this gateway on the ready workers."""
        free = total = 0
        for v in self.views.values():
            if v.state == "ready":
                total += v.room
                free += max(0, v.room - v.inflight)
        return free, total

    def choose(self, affinity: bytes | None, exclude: set[str]) -> WorkerView | None:
        return choose_worker(list(self.views.values()), affinity, exclude)

    # Slots and completions are the Lease's (gateway/capacity/lease.py) to claim and record; nothing
    # else in the gateway touches a worker's in-flight count.

    def claim_slot(
        self, affinity: bytes | None, exclude: Collection[str], ticket: Ticket | None = None
    ) -> WorkerView | None:
        """Count one request in flight on the best worker not in `exclude`; None: no room.
        With its `ticket`, its size is kept there until `free_slot` (the capacity model
        counts what the worker's last report does not show yet by what was sent)."""
        view = self.choose(affinity, set(exclude))
        if view is not None:
            view.inflight += 1
            if ticket is not None:
                view.sent[ticket.request_id] = (ticket.prompt_tokens, ticket.max_tokens)
        return view

    def free_slot(self, view: WorkerView, ticket: Ticket | None = None) -> None:
        view.inflight = max(view.inflight - 1, 0)
        if ticket is not None:
            view.sent.pop(ticket.request_id, None)

    def record_completion(self, held_s: float | None = None) -> None:
        """A request was served (holding a slot `held_s`): the completion rate behind
        `estimated_wait_s`, and the service time the autoscaler reads."""
        now = self.clock()
        self._finished.append(now)
        if held_s is not None:
            self._service.append((now, held_s))

    def lost(self, url: str) -> "asyncio.Future[None]":
        """Done while the worker at `url` is unreachable or stalled: requests waiting on it
        for an answer stop waiting (none of the answer reached the client) and retry. A
        future, not an Event, so a request waits on it beside its send without a task."""
        lost = self._lost.get(url)
        if lost is None:
            lost = self._lost[url] = asyncio.get_running_loop().create_future()
            view = self.views.get(url)
            if view is None or view.state in _LOST_STATES:
                lost.set_result(None)
        return lost

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
        await asyncio.gather(*(self.refresh_one(v) for v in self.views.values()))
        self.controller.kick()

    async def refresh_one(self, view: WorkerView) -> None:
        if view.kind != "switchyard":
            await self.foreign.probe(view)
            return
        report = await self.client.load(view.url)
        if report is None:
            # A switchyard member that does not answer /load: a server that is not ours
            # (configure its kind), or ours not up yet. Alive on /health = ready.
            alive = await self.client.alive(view.url)
            view.answered = view.answered or alive
            self._set_state(view, "ready" if alive else "unreachable")
            return
        view.answered = True
        view.num_running = report.num_running
        view.num_waiting = report.num_waiting
        view.kv_free_tokens = report.kv_free_tokens
        view.kv_total_tokens = report.kv_total_tokens
        view.max_model_len = report.max_model_len or None
        view.vocab_size = report.vocab_size
        view.seats = None if report.seats is None else seats_share(report.seats, self.seat_share)
        view.decode_step_s = report.decode_step_s
        view.prefill_tokens_per_s = report.prefill_tokens_per_s
        view.queued_prompt_tokens = report.queued_prompt_tokens
        view.running_prefill_tokens = report.running_prefill_tokens
        view.running_remaining = tuple(report.running_remaining)
        view.waiting_max_tokens = tuple(report.waiting_max_tokens)
        view.itl_target_s = report.itl_target_s
        view.step_s = report.step_s
        self.note_reported(view, report.state)

    def note_reported(self, view: WorkerView, state: str) -> None:
        """A member's reported state (its /load, or a foreign probe's): a start seen from
        loading to ready is timed for `_start_s`, then the state applies (`_set_state`)."""
        if state == "loading":
            view.seen_loading = True
        elif state == "ready" and view.ready_at is None:
            view.ready_at = self.clock()
            if view.seen_loading:  # seen starting: how long a start takes
                self._start_times.append(view.ready_at - view.joined_at)
        self._set_state(view, state)

    def record_service(
        self,
        url: str,
        prompt_tokens: int,
        output_tokens: int,
        *,
        first_token_s: float | None = None,
        decode_s: float = 0.0,
        total_s: float | None = None,
    ) -> None:
        """An answer a foreign member gave, for its measured capacity (`foreign.py`)."""
        self.foreign.record_service(
            url, prompt_tokens, output_tokens,
            first_token_s=first_token_s, decode_s=decode_s, total_s=total_s,
        )  # fmt: skip

    def model_limits(self) -> tuple[int | None, int | None]:
        """(vocabulary size, context length) every reporting member accepts: the smallest
        reported of each; None where no member reports one."""
        vocab = [v.vocab_size for v in self.views.values() if v.vocab_size]
        ctx = [v.max_model_len for v in self.views.values() if v.max_model_len]
        return (min(vocab) if vocab else None, min(ctx) if ctx else None)

    def _set_state(self, view: WorkerView, reported: str) -> None:
        if self.views.get(view.url) is not view:
            return  # it left the pool while its /load was on the way
        state = self.flaps.state(view.url, reported, self.clock())
        if reported == "ready" and state == "stalled":
            state = "stalled (held)"  # logged once, below; acted on as stalled
        before = self._reported.get(view.url)
        if before != state:
            # A member that has not answered yet is starting, not lost: debug, not info.
            quiet = before is None and state == "unreachable"
            if state == "stalled (held)":
                log.warning(
                    "pool %s: worker %s reports ready again; held out of the rotation until "
                    "it stays ready %.0f s (it flapped)",
                    self.name,
                    view.url,
                    self.flaps.hold_s(view.url),
                )
            else:
                log.log(
                    logging.DEBUG if quiet else logging.INFO,
                    "pool %s: worker %s is %s",
                    self.name,
                    view.url,
                    state,
                )
            self._reported[view.url] = state
        if state == "stalled (held)":
            state = "stalled"
        view.state = state
        lost = self._lost.get(view.url)  # made by the first waiter (none: nobody to tell)
        if lost is None:
            pass
        elif state in _LOST_STATES:
            if not lost.done():
                lost.set_result(None)
        elif lost.done():
            del self._lost[view.url]  # its waiters were told; the next ones get a new one

    def snapshot(self) -> list[dict]:
        return [
            {
                "url": v.url,
                "origin": self.origins.get(v.url, "config"),
                "state": v.state,
                "inflight": v.inflight,
                "running": v.num_running,
                "waiting": v.num_waiting,
                "kv_free_tokens": v.kv_free_tokens,
            }
            for v in self.views.values()
        ]


def _starting(view: WorkerView) -> bool:
    """Joined and not answered yet: its server is still starting."""
    return view.state == "unreachable" and not view.answered


def refusal_reason(error: Exception) -> str:
    """The `reason` label of an admission refusal: predicted (over the TTFT target at
    arrival), late (its latest start passed in the queue), provider (a hosted pool's
    provider limits), queue_full, no_replica or deadline (its deadline passed first)."""
    if isinstance(error, ProviderLimited):
        return "provider"
    if isinstance(error, OverCapacity):
        return "predicted" if error.predicted_s is not None else "late"
    if isinstance(error, QueueFull):
        return "queue_full"
    if isinstance(error, DeadlineExceeded):
        return "deadline"
    return "no_replica"
