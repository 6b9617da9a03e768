"""The continuous-batching scheduler. No torch: block ids and token counts only.

One rule: every request has `num_computed_tokens`; each step packs running decodes
first, then prefill chunks (running ones, then new admissions), under a token budget.
When KV blocks run out, the scheduler preempts by recompute.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache import KVCacheManager
from workers.engine.config import SchedulerConfig
from workers.engine.request import FinishReason, Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What one step computes."""

    # (request, number of new tokens to compute), decodes first, then prefill chunks.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    # Requests that lost their KV this step and went back to the head of the queue.
    preempted: list[Request] = field(default_factory=list)
    # Requests dropped at dequeue because their deadline had passed (never prefilled).
    expired: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def effective_priority(request: Request, step: int, aging_steps: int) -> int:
    """Priority after ageing: one level better per `aging_steps` steps spent waiting."""
    return request.priority - (step - request.arrival_step) // max(aging_steps, 1)


def pick_victim(candidates: list[Request]) -> Request:
    """Preemption victim: the lowest priority, then the least computed work, then newest."""
    return max(candidates, key=lambda r: (r.priority, -r.num_computed_tokens, r.arrival_time))


def prefill_chunk(
    num_remaining: int,
    budget: int,
    chunk_cap: int | None,
    chunked: bool,
    context: int = 0,
    parity: int | None = None,
) -> int:
    """Tokens of a prefill to compute now; 0 when it must wait for a later step.

    A chunk attending over `context` cached tokens is shortened to what its cost
    (`chunk_cost`) lets into the budget, but never below one token.
    """
    if not chunked:
        return num_remaining if num_remaining <= budget else 0
    cap = budget if chunk_cap is None else min(budget, chunk_cap)
    if parity and context:
        cap = min(cap, max(1, budget * parity // (parity + context)))
    return min(num_remaining, cap)


def chunk_cost(num_new: int, context: int, parity: int | None) -> int:
    """Budget a prefill chunk of `num_new` tokens after `context` cached ones takes: each
    token's attention over the context weighs `context / parity` of a token's other work."""
    if not parity or not context:
        return num_new
    return -(-num_new * (parity + context) // parity)


class Scheduler:
    """Owns the waiting queue and the running batch; the engine owns everything else."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: list[Request] = []  # index 0 is the head of the queue
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.arrival_step = self.step_count
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        cfg = self.config
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        scheduled: dict[str, int] = {}  # tokens to compute
        charged: dict[str, int] = {}  # budget they take (`chunk_cost`)
        for req in decodes + prefills:
            if req.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            chunked = self._may_chunk(req)
            remaining = req.num_tokens - req.num_computed_tokens
            # Only prefill chunks pay for their context; a decode is one token of budget.
            context = req.num_computed_tokens if chunked and remaining > 1 else 0
            num_new = prefill_chunk(
                remaining,
                budget,
                cfg.max_prefill_chunk,
                chunked,
                context,
                cfg.attention_parity_context,
            )
            if num_new == 0:
                continue
            # A prompt's later chunks were reserved with its first (`_lookahead`).
            lookahead = self._lookahead(req, req.num_computed_tokens + num_new)
            while self.kv.allocate_slots(req, num_new, (), lookahead) is None:
                victim = pick_victim(self.running)
                budget += charged.pop(victim.request_id, 0)
                scheduled.pop(victim.request_id, None)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = num_new
                charged[req.request_id] = chunk_cost(num_new, context, cfg.attention_parity_context)
                budget -= charged[req.request_id]
        out.scheduled = [(self.requests[rid], n) for rid, n in scheduled.items()]
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        cfg = self.config
        now = self.clock()
        order = sorted(
            self.waiting,
            key=lambda r: effective_priority(r, self.step_count, cfg.aging_steps),
        )
        # Only never-admitted requests expire: a preempted one has already streamed tokens.
        out.expired = [
            r
            for r in order
            if r.deadline is not None and r.first_scheduled_time is None and now > r.deadline
        ]
        for req in out.expired:
            self.finish(req, FinishReason.DEADLINE)
        admitted: list[Request] = []
        for req in order:
            if req.is_finished:
                continue
            if len(self.running) + len(admitted) >= cfg.max_num_seqs or budget <= 0:
                break
            hits, num_hit = self.kv.get_computed_blocks(req)
            chunked = self._may_chunk(req)
            context = num_hit if chunked else 0
            num_new = prefill_chunk(
                req.num_tokens - num_hit,
                budget,
                cfg.max_prefill_chunk,
                chunked,
                context,
                cfg.attention_parity_context,
            )
            # Strict order: the head waits for room rather than being bypassed; only
            # priority (bounded by ageing) lets newer work go first.
            lookahead = self._lookahead(req, num_hit + num_new)
            if num_new == 0 or self.kv.allocate_slots(req, num_new, hits, lookahead) is None:
                break
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            admitted.append(req)
            out.scheduled.append((req, num_new))
            budget -= chunk_cost(num_new, context, cfg.attention_parity_context)
        if admitted:
            ids = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in ids]
            self.running.extend(admitted)

    @staticmethod
    def _lookahead(req: Request, num_after_chunk: int) -> int:
        """Tokens left to compute once this chunk is (`num_after_chunk` computed; 0 for a
        decode). Their blocks are taken with the first chunk's, so a prompt's KV is one run
        of neighbouring blocks wherever the pool has one: attention then reads the context
        as one view instead of gathering a copy of it for every chunk and layer, and a
        prompt that started is never preempted for its own growth."""
        return max(0, req.num_tokens - num_after_chunk)

    def _may_chunk(self, req: Request) -> bool:
        # Without chunked prefill, a request longer than a whole step (a preempted one whose
        # output grew past the budget) would wait forever at the head of the queue.
        cfg = self.config
        return cfg.enable_chunked_prefill or req.num_tokens > cfg.max_num_batched_tokens

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        req.arrival_step = min(req.arrival_step, self.step_count)
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.num_preemptions += 1

    def advance(self, out: SchedulerOutput) -> None:
        """Record that the scheduled tokens were computed; cache blocks that became full."""
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new
            self.kv.cache_blocks(req, req.num_computed_tokens)

    def finish(
        self, req: Request, reason: FinishReason, stop_reason: str | int | None = None
    ) -> None:
        """Take a request out of the queue or batch and free its blocks now."""
        if req.is_finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def abort(self, request_id: str) -> Request | None:
        """Abort a request wherever it is; None when it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req
