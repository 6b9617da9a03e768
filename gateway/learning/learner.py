"""Labels from live traffic: shadow runs, escalations and the request records feedback needs.

The request path calls three hooks, each of which only decides and spawns (`gw.spawn`):
the client never waits for anything here.

- `on_plan`: an `auto` request of a tenant with `feedback` on is remembered (features,
  the pool that serves it, its text if the tenant opted in) for `feedback_ttl_s`.
- `on_answer`: after a non-streaming `auto` answer, a `shadow_fraction` of requests is
  run again on the other pool. Shadow work is the first to be shed: it runs only while
  the other pool has nothing queued and a free slot (it never waits behind real
  requests, and it asks the worker for a lower priority than any tenant's), within the
  operator's `shadow_tokens_per_minute` across all replicas (a Redis counter per
  minute, shared fairly among the tenants asking: `shadow_budget.py`), and it is never
  charged to the tenant. Its answer is read as untrusted as the main path's: within
  `SHADOW_TIMEOUT_S` from its start and the request's answer bound. The tenant's judge
  compares the two answers and the label goes to the tenant's stream.
- `on_escalation`: an escalated request already has both answers: the judge labels it.

A request has at most one label per source (`label_store.py`): a second feedback on it
records nothing, and says whether it agrees with the first (`feedback`).
"""

import asyncio
import logging
import random
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
from prometheus_client import CollectorRegistry, Counter

from cascade.features import RequestView, request_view
from cascade.labels import Label, builtin_verdict, features_of
from cascade.policy import LearningSettings, learning_for
from gateway.billing.prices import Tokens, cost_nanos
from gateway.capacity.fair_queue import Ticket
from gateway.capacity.lease import Lease, NoReplica
from gateway.capacity.refusals import DeadlineExceeded, OverCapacity, QueueFull
from gateway.learning.label_store import LabelStore, RequestRecord
from gateway.learning.shadow_budget import ShadowBudget
from gateway.serving.dispatch import send_attempt
from gateway.serving.plan import GatewayChatRequest, Plan, PublicRequest
from quota.budget import NANOS
from workers.api.client import UpstreamError, UpstreamResponse
from workers.api.upstreams.fields import fields_of

if TYPE_CHECKING:  # the gateway holds its learner
    from gateway.gateway import Gateway

log = logging.getLogger(__name__)

SHADOW_PRIORITY = 100  # workers admit lower numbers first and preempt higher ones first
SHADOW_TIMEOUT_S = 60.0
JUDGE_TIMEOUT_S = 10.0


class FeedbackRecorded(NamedTuple):
    """The request's feedback as it stands after a post."""

    ok: bool  # its outcome
    score: float | None
    first: bool  # this post recorded it; False: an earlier one had (and this one nothing)


class LearningMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.shadow = Counter(
            "switchyard_cascade_shadow_runs",
            "Shadow runs by outcome (run, busy, budget, failed, stream).",
            ["outcome"],
            registry=registry,
        )
        self.labels = Counter(
            "switchyard_cascade_labels",
            "Routing labels recorded, by source and verdict (ok, not_ok, unknown).",
            ["source", "verdict"],
            registry=registry,
        )


def _answer_bytes(gw: "Gateway", plan: Plan, req: PublicRequest) -> int:
    """The most a worker's answer to this request may take, as on the main path
    (`gateway.serving.attempts.answer_bytes`): the configured floor, plus an allowance per
    token its samples may produce (the prompt again when it is echoed)."""
    config = gw.config
    echoed = plan.prompt_tokens if getattr(req, "echo", False) else 0
    per_sample = plan.max_tokens + echoed
    return config.upstream_min_answer_bytes + config.upstream_bytes_per_token * plan.n * per_sample


async def _read_answer(upstream: UpstreamResponse, deadline: float, max_bytes: int) -> dict | None:
    """A shadow answer, an object read whole by `deadline` (monotonic) and within
    `max_bytes`; None when it is late, too large, broken or not an object."""
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
            answer = msgspec.json.decode(await upstream.aread(max_bytes))
    except (TimeoutError, UpstreamError, msgspec.DecodeError) as exc:
        log.debug("shadow answer unread: %r", exc)
        return None
    return answer if isinstance(answer, dict) else None


def _view_and_prompt(req: PublicRequest, max_tokens: int) -> tuple[RequestView, dict[str, Any]]:
    if isinstance(req, GatewayChatRequest):
        messages = [msgspec.structs.asdict(m) for m in req.messages]
        messages = msgspec.to_builtins(messages)
        return request_view("", messages, max_tokens), {"messages": messages}
    prompt = req.prompt if isinstance(req.prompt, str) else ""
    return request_view(prompt, None, max_tokens), {"prompt": prompt}


def answer_of(body: dict) -> tuple[str, list[float], int | None]:
    """(text, chosen-token logprobs, completion tokens) of a completion's first choice."""
    choice = (body.get("choices") or [{}])[0]
    text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
    lp = choice.get("logprobs") or {}
    if "content" in lp:
        logprobs = [t["logprob"] for t in lp["content"] or []]
    else:
        logprobs = [x for x in lp.get("token_logprobs") or [] if x is not None]
    usage = body.get("usage") or {}
    return text, logprobs, usage.get("completion_tokens")


class Learner:
    """The hooks above, over the label store; one per gateway process."""

    def __init__(
        self,
        store: LabelStore,
        registry: CollectorRegistry,
        rng: random.Random | None = None,
        budget: ShadowBudget | None = None,  # None: no shadow runs
    ) -> None:
        self.store = store
        self.budget = budget
        self.metrics = LearningMetrics(registry)
        self.rng = rng or random.Random()

    # -- hooks (never await on the request path) -------------------------------------

    def on_plan(self, gw: "Gateway", plan: Plan, req: PublicRequest) -> None:
        settings = self._settings(gw, plan)
        if settings is None or not settings.feedback:
            return
        view, prompt = _view_and_prompt(req, plan.max_tokens)
        record = RequestRecord(
            request_id=plan.request_id,
            served_pool=plan.pool,
            small_pool=gw.router.small_pool,
            features=features_of(view),
            score=plan.score,
            prompt=prompt if settings.keep_prompts else None,
        )
        gw.spawn(
            self._quietly(self.store.remember(plan.tenant_id, record, settings.feedback_ttl_s))
        )

    def on_answer(self, gw: "Gateway", plan: Plan, req: PublicRequest, content: bytes) -> None:
        settings = self._settings(gw, plan)
        if settings is None or plan.route != "classifier" or settings.shadow_fraction <= 0:
            return
        if self.rng.random() >= settings.shadow_fraction:
            return
        if gw.router.settings.shadow_tokens_per_minute <= 0:
            self.metrics.shadow.labels("budget").inc()
            return
        gw.spawn(self._quietly(self._shadow(gw, plan, req, content, settings)))

    def on_escalation(
        self, gw: "Gateway", plan: Plan, req: PublicRequest, small: dict, large: dict
    ) -> None:
        settings = self._settings(gw, plan)
        if settings is None:
            return
        coro = self._label_pair(
            gw, plan, req, small, large, settings, "escalation", large_served=True
        )
        gw.spawn(self._quietly(coro))

    # -- feedback ---------------------------------------------------------------------

    async def feedback(
        self,
        gw: "Gateway",
        tenant_id: str,
        request_id: str,
        ok: bool,
        score: float | None,
    ) -> FeedbackRecorded | None:
        """Record the application's verdict on its own request, unless an earlier feedback
        did (the first stands). None when the request is unknown to this tenant (never
        made, another tenant's, or expired)."""
        record = await self.store.recall(tenant_id, request_id)
        if record is None:
            return None
        settings = learning_for(gw.router.settings, tenant_id) or LearningSettings()
        small_served = record.served_pool == record.small_pool
        label = Label(
            tenant=tenant_id,
            request_id=request_id,
            source="feedback",
            weak_ok=ok if small_served else None,
            strong_ok=None if small_served else ok,
            served_pool=record.served_pool,
            features=record.features,
            score=record.score,
            feedback_score=score,
            time=time.time(),
        )
        recorded = await self.store.add(label, settings, record.prompt)
        if recorded is not None:
            first_ok = recorded.weak_ok if recorded.weak_ok is not None else recorded.strong_ok
            return FeedbackRecorded(bool(first_ok), recorded.feedback_score, first=False)
        self._count(label)
        return FeedbackRecorded(ok, score, first=True)

    # -- internals --------------------------------------------------------------------

    def _settings(self, gw: "Gateway", plan: Plan) -> LearningSettings | None:
        if gw.router is None or plan.score is None:
            return None
        return learning_for(gw.router.settings, plan.tenant_id)

    async def _quietly(self, coro: Coroutine[Any, Any, Any]) -> None:
        try:
            await coro
        except Exception:
            log.exception("recording a routing label failed")

    async def _shadow(
        self,
        gw: "Gateway",
        plan: Plan,
        req: PublicRequest,
        content: bytes,
        settings: LearningSettings,
    ) -> None:
        router = gw.router
        other = router.large_pool if plan.pool == router.small_pool else router.small_pool
        pool = gw.pools[other]
        if len(pool.queue) or not pool.has_room():
            self.metrics.shadow.labels("busy").inc()
            return
        limit = router.settings.shadow_tokens_per_minute
        tokens = plan.attempt_tokens
        if self.budget is None or not await self.budget.take(
            plan.tenant_id, tokens, limit, time.time()
        ):
            self.metrics.shadow.labels("budget").inc()
            return
        now = time.monotonic()
        ticket = Ticket(
            plan.request_id + "-shadow",
            plan.tenant_id,
            plan.attempt_tokens,
            now,
            now + SHADOW_TIMEOUT_S,
        )
        lease = Lease(pool, ticket, plan.affinity)
        try:
            lease.enqueue()
        except (QueueFull, DeadlineExceeded, OverCapacity):
            self.metrics.shadow.labels("busy").inc()
            return
        served = False
        try:
            if not lease.granted:  # real requests arrived first: shed, never wait
                self.metrics.shadow.labels("busy").inc()
                return
            want_logprobs = other == router.small_pool
            body = msgspec.json.decode(gw.body_for(req, plan, other, want_logprobs))
            if fields_of(gw.pools[other].kind).priority:
                body["priority"] = SHADOW_PRIORITY
            path = "/v1/chat/completions" if plan.chat else "/v1/completions"
            try:
                upstream = await send_attempt(
                    gw.workers,
                    lease,
                    path,
                    msgspec.json.encode(body),
                    stream=False,
                    attempts=1,
                    retry_cap_s=0.0,
                    rng=self.rng,
                )
            except (NoReplica, DeadlineExceeded, Exception) as exc:  # shed: a busy worker
                log.debug("shadow run of %s not served: %r", plan.request_id, exc)
                self.metrics.shadow.labels("failed").inc()
                return
            try:
                shadowed = None
                if upstream.status_code == 200:
                    max_bytes = _answer_bytes(gw, plan, req)
                    shadowed = await _read_answer(upstream, ticket.deadline, max_bytes)
                served = shadowed is not None
            finally:
                await upstream.aclose()
        finally:
            lease.release(served=served)
        if shadowed is None:
            self.metrics.shadow.labels("failed").inc()
            return
        self.metrics.shadow.labels("run").inc()
        _count_shadow_spend(gw, other, plan, shadowed)
        routed = msgspec.json.decode(content)
        small, large = (routed, shadowed) if plan.pool == router.small_pool else (shadowed, routed)
        await self._label_pair(gw, plan, req, small, large, settings, "shadow", large_served=False)

    async def _label_pair(
        self,
        gw: "Gateway",
        plan: Plan,
        req: PublicRequest,
        small: dict,
        large: dict,
        settings: LearningSettings,
        source: str,
        large_served: bool,
    ) -> None:
        small_text, small_lp, small_tokens = answer_of(small)
        large_text, _, large_tokens = answer_of(large)
        view, prompt = _view_and_prompt(req, plan.max_tokens)
        verdict = await self.judge(gw, settings, prompt, small_text, large_text, small_lp)
        label = Label(
            tenant=plan.tenant_id,
            request_id=plan.request_id,
            source=source,
            weak_ok=verdict,
            strong_ok=True,
            served_pool=gw.router.large_pool if large_served else plan.pool,
            features=features_of(view),
            judge=settings.judge,
            score=plan.score,
            small_tokens=small_tokens,
            large_tokens=large_tokens,
            time=time.time(),
        )
        await self.store.add(label, settings, prompt)
        if large_served and settings.feedback:
            await self.store.served_pool(plan.tenant_id, plan.request_id, label.served_pool)
        self._count(label)

    async def judge(
        self,
        gw: "Gateway",
        settings: LearningSettings,
        prompt: dict[str, Any],
        small_text: str,
        large_text: str,
        small_logprobs: Sequence[float],
    ) -> bool | None:
        """Was the small answer good enough? None: the judge could not tell."""
        if settings.judge != "http":
            return builtin_verdict(
                settings.judge,
                small_text,
                large_text,
                small_logprobs,
                settings.judge_min_mean_logprob,
                settings.judge_min_token_logprob,
            )
        try:
            status, answer = await gw.workers.post_json(
                settings.judge_url,
                {**prompt, "small": small_text, "large": large_text},
                JUDGE_TIMEOUT_S,
            )
            ok = answer.get("ok") if status == 200 else None
        except (UpstreamError, AttributeError) as exc:
            log.warning("the http judge at %s failed: %r", settings.judge_url, exc)
            return None
        return ok if isinstance(ok, bool) else None

    def _count(self, label: Label) -> None:
        verdict = {None: "unknown", True: "ok", False: "not_ok"}[label.weak_ok]
        self.metrics.labels.labels(label.source, verdict).inc()


def _count_shadow_spend(gw: "Gateway", pool: str, plan: Plan, answer: dict) -> None:
    """A shadow run's cost at the pool's price, in the operator's metric (never charged to
    the tenant): its answer's usage, clamped to what the request could have used."""
    price = gw.prices.price(pool)
    usage = answer.get("usage")
    if price is None or gw.metrics is None or not isinstance(usage, dict):
        return
    completion = usage.get("completion_tokens")
    prompt = usage.get("prompt_tokens")
    if not isinstance(completion, int) or not isinstance(prompt, int):
        return
    completion = max(0, min(completion, plan.n * plan.max_tokens))
    prompt = max(0, min(prompt, plan.attempt_tokens - completion))
    used = Tokens(prompt, 0, completion)
    cost = cost_nanos(price, used, gw.prices.compute_per_token_s(pool))
    gw.metrics.shadow_spend.labels(pool).inc(cost / NANOS)
