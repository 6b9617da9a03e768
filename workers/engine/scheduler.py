"""The continuous-batching scheduler. No torch: block ids and token counts only.

One rule: every request has `num_computed_tokens`; each step packs running decodes
first (a decode with drafts to verify, speculative decoding, as one chunk of its next
token and the drafts), then prefill chunks, under a token budget. The prefill chunks go
tenant by tenant, to whichever tenant has been served the fewest tokens lately
(`TenantService`); within a tenant, its running prefills first, then its new admissions.
When KV blocks run out, the scheduler preempts by recompute.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache import KVCacheManager
from workers.engine.config import SchedulerConfig
from workers.engine.request import FinishReason, Request, RequestStatus
from workers.engine.step_model import StepModel


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


@dataclass
class _Step:
    """One `schedule` call's bookkeeping: what is scheduled, what it costs of the budget."""

    budget: int
    scheduled: dict[str, tuple[Request, int]] = field(default_factory=dict)  # by request id
    charged: dict[str, int] = field(default_factory=dict)  # budget taken, by request id
    given: dict[str | None, int] = field(default_factory=dict)  # budget taken, by tenant
    admitted: list[Request] = field(default_factory=list)

    def schedule(self, req: Request, num_new: int, cost: int) -> None:
        self.scheduled[req.request_id] = (req, num_new)
        self.charged[req.request_id] = cost
        self.given[req.tenant] = self.given.get(req.tenant, 0) + cost
        self.budget -= cost

    def unschedule(self, req: Request) -> None:
        """A request preempted after it was scheduled gives its budget back."""
        if self.scheduled.pop(req.request_id, None) is not None:
            cost = self.charged.pop(req.request_id)
            self.given[req.tenant] -= cost
            self.budget += cost


def _fit_drafts(decodes: list[Request], budget: int) -> None:
    """Trim the decodes' drafts, in order, to what the step's budget holds beside one token
    for every decode (drafts never crowd a decode out of the step)."""
    room = budget - len(decodes)
    for req in decodes:
        if req.spec_token_ids:
            req.spec_token_ids = req.spec_token_ids[: max(0, room)]
            room -= len(req.spec_token_ids)


def _running_only(lanes: dict[str | None, deque[Request]]) -> dict[str | None, deque[Request]]:
    """The lanes without their waiting requests (once admissions stop for the step)."""
    kept = {
        t: deque(r for r in lane if r.status is RequestStatus.RUNNING) for t, lane in lanes.items()
    }
    return {t: lane for t, lane in kept.items() if lane}


class TenantService:
    """Tokens of work each tenant was served lately (prefill chunks at their budget cost,
    decodes at one), decaying by half every `half_life_steps` steps. Tenants whose count has
    decayed below one token are forgotten, so the table holds only recent tenants."""

    def __init__(self, half_life_steps: int) -> None:
        self._decay = 0.5 ** (1 / half_life_steps) if half_life_steps > 0 else 0.0
        self._served: dict[str | None, tuple[float, int]] = {}  # tenant -> (tokens, at step)

    def served(self, tenant: str | None, step: int) -> float:
        tokens, at = self._served.get(tenant, (0.0, step))
        return tokens * self._decay ** (step - at)

    def charge(self, tenant: str | None, tokens: float, step: int) -> None:
        self._served[tenant] = (self.served(tenant, step) + tokens, step)

    def forget_idle(self, step: int) -> None:
        for tenant in [t for t in self._served if self.served(t, step) < 1.0]:
            del self._served[tenant]

    def __len__(self) -> int:
        return len(self._served)


class Scheduler:
    """Owns the waiting queue and the running batch; the engine owns everything else."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float],
        step_model: StepModel | None = None,
    ) -> None:
        self.config = config
        # What a step costs, learned by the engine; with `config.itl_target_s` it bounds
        # the batch (`seats`) and each step's tokens (`token_budget`).
        self.step_model = step_model
        self.kv = kv
        self.clock = clock
        self.waiting: list[Request] = []  # index 0 is the head of the queue
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.num_preemptions = 0
        self.service = TenantService(config.fair_share_half_life_steps)
        self._seats = config.max_num_seqs  # this step's `seats()`
        self._budget = config.max_num_batched_tokens  # this step's `token_budget()`

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _step_bound_s(self) -> float | None:
        """The time a step may be predicted to take (ITL target x headroom); None: unbounded
        (no target, or the step model has not learned yet)."""
        target = self.config.itl_target_s
        if target is None or self.step_model is None or self.step_model.fit is None:
            return None
        return target * self.config.itl_headroom

    def seats(self) -> int:
        """Sequences the running batch may hold: `max_num_seqs`, or fewer where a decode
        step of more would pass the ITL target. Running sequences past it are not
        preempted; admissions wait until the batch is below it."""
        bound = self._step_bound_s()
        cap = self.config.max_num_seqs
        if bound is None:
            return cap
        assert self.step_model is not None and self.step_model.fit is not None
        return self.step_model.fit.max_seqs(bound, cap, self.step_model.context_per_seq())

    def token_budget(self) -> int:
        """Tokens the next step may compute: `max_num_batched_tokens`, or fewer where a
        step that long, with the running batch and one admission, would pass the ITL
        target (a long prompt is then prefilled in shorter chunks, and everyone's next
        token still comes in time). Never fewer than the running decodes plus one."""
        cap = self.config.max_num_batched_tokens
        bound = self._step_bound_s()
        if bound is None:
            return cap
        assert self.step_model is not None and self.step_model.fit is not None
        context = sum(r.num_computed_tokens for r in self.running)
        num_seqs = len(self.running) + 1
        return self.step_model.fit.max_tokens(bound, num_seqs, max(cap, num_seqs), context)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.arrival_step = self.step_count
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        out = SchedulerOutput()
        waiting = self._waiting_order()
        self._expire(waiting, out)
        self._budget = self.token_budget()
        self._seats = self.seats()
        step = _Step(self._budget)
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        _fit_drafts(decodes, step.budget)
        for req in decodes:
            self._schedule_running(req, step, out)
        # Prefill chunks: one at a time to the tenant served least (lately, plus what it has
        # been given this step), the head of its lane. A lane is the tenant's running
        # prefills, then its waiting requests in priority order. A step that preempted
        # admits nothing.
        lanes: dict[str | None, deque[Request]] = {}
        for req in self.running:
            if req.num_tokens - req.num_computed_tokens > 1:
                lanes.setdefault(req.tenant, deque()).append(req)
        admitting = not out.preempted
        for req in waiting if admitting else ():
            if not req.is_finished:
                lanes.setdefault(req.tenant, deque()).append(req)
        while step.budget > 0 and lanes:
            tenant = min(lanes, key=lambda t: self._lane_key(lanes, t, step))
            lane = lanes[tenant]
            req = lane.popleft()
            if not lane:
                del lanes[tenant]
            if req.status is RequestStatus.RUNNING:
                self._schedule_running(req, step, out)
                stop = bool(out.preempted)
            else:
                # Strict order: a head that finds no seat or no KV stops admissions this
                # step rather than being bypassed (running prefills still go on).
                stop = not self._admit(req, step)
            if stop and admitting:
                admitting = False
                lanes = _running_only(lanes)
        for tenant, tokens in step.given.items():
            self.service.charge(tenant, tokens, self.step_count)
        self.service.forget_idle(self.step_count)
        if step.admitted:
            ids = {id(r) for r in step.admitted}
            self.waiting = [r for r in self.waiting if id(r) not in ids]
            self.running.extend(step.admitted)
        out.scheduled = list(step.scheduled.values())
        return out

    def _lane_key(
        self, lanes: dict[str | None, deque[Request]], tenant: str | None, step: "_Step"
    ) -> tuple[int, float]:
        """Which lane's head goes next: the better priority, then the tenant served least."""
        head = lanes[tenant][0]
        priority = (
            head.priority
            if head.status is RequestStatus.RUNNING
            else effective_priority(head, self.step_count, self.config.aging_steps)
        )
        given = step.given.get(tenant, 0)
        return priority, self.service.served(tenant, self.step_count) + given

    def _waiting_order(self) -> list[Request]:
        return sorted(
            (r for r in self.waiting if not r.is_finished),
            key=lambda r: effective_priority(r, self.step_count, self.config.aging_steps),
        )

    def _expire(self, waiting: list[Request], out: SchedulerOutput) -> None:
        # Only never-admitted requests expire: a preempted one has already streamed tokens.
        now = self.clock()
        out.expired = [
            r
            for r in waiting
            if r.deadline is not None and r.first_scheduled_time is None and now > r.deadline
        ]
        for req in out.expired:
            self.finish(req, FinishReason.DEADLINE)

    def _schedule_running(self, req: Request, step: "_Step", out: SchedulerOutput) -> None:
        """A running request's next tokens (a decode, or a prefill chunk), preempting others
        by recompute while its KV does not fit."""
        cfg = self.config
        if req.status is not RequestStatus.RUNNING or step.budget <= 0:
            return
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining == 1 and req.spec_token_ids and self._schedule_verify(req, step):
            return
        chunked = self._may_chunk(req)
        # Only prefill chunks pay for their context; a decode is one token of budget.
        context = req.num_computed_tokens if chunked and remaining > 1 else 0
        num_new = prefill_chunk(
            remaining,
            step.budget,
            cfg.max_prefill_chunk,
            chunked,
            context,
            cfg.attention_parity_context,
        )
        if num_new == 0:
            return
        # A prompt's later chunks were reserved with its first (`_lookahead`).
        lookahead = self._lookahead(req, req.num_computed_tokens + num_new)
        while self.kv.allocate_slots(req, num_new, (), lookahead) is None:
            victim = pick_victim(self.running)
            step.unschedule(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return
        step.schedule(req, num_new, chunk_cost(num_new, context, cfg.attention_parity_context))

    def _schedule_verify(self, req: Request, step: "_Step") -> bool:
        """A decode with drafts: its next token and its drafts in one chunk, when their KV
        fits without preempting anyone; else False, the drafts dropped (it decodes alone)."""
        num_new = 1 + len(req.spec_token_ids)
        if self.kv.allocate_slots(req, num_new) is None:
            req.spec_token_ids = []
            return False
        step.schedule(req, num_new, num_new)
        return True

    def _admit(self, req: Request, step: "_Step") -> bool:
        """Admit a waiting request with its first prefill chunk; False when it finds no seat,
        no budget or no KV (it stays at the head of the queue)."""
        cfg = self.config
        if len(self.running) + len(step.admitted) >= self._seats:
            return False
        hits, num_hit = self.kv.get_computed_blocks(req)
        chunked = self._may_chunk(req)
        context = num_hit if chunked else 0
        num_new = prefill_chunk(
            req.num_tokens - num_hit,
            step.budget,
            cfg.max_prefill_chunk,
            chunked,
            context,
            cfg.attention_parity_context,
        )
        lookahead = self._lookahead(req, num_hit + num_new)
        if num_new == 0 or self.kv.allocate_slots(req, num_new, hits, lookahead) is None:
            return False
        req.num_computed_tokens = num_hit
        req.num_prefill_tokens = req.num_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
        req.status = RequestStatus.RUNNING
        step.admitted.append(req)
        step.schedule(req, num_new, chunk_cost(num_new, context, cfg.attention_parity_context))
        return True

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
        # The same when the ITL bound shortened this step's budget below a prompt.
        cfg = self.config
        return cfg.enable_chunked_prefill or req.num_tokens > self._budget

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        req.arrival_step = min(req.arrival_step, self.step_count)
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.num_preemptions += 1

    def advance(self, out: SchedulerOutput) -> None:
        """Record that the scheduled tokens were computed; cache blocks that became full.

        A verify chunk's drafts are not counted: their KV is written, but it becomes the
        request's only as each draft is verified and appended (`accept_draft`), so the
        prefix cache never registers a block holding an unverified token."""
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new - req.num_draft_tokens(num_new)
            self.kv.cache_blocks(req, req.num_computed_tokens)

    def accept_draft(self, req: Request) -> None:
        """A draft of `req`'s verify step was verified and appended: the KV that step wrote
        for it is the request's now (the next draft's, or its next token's, follows)."""
        req.num_computed_tokens += 1
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
