"""`model: auto`: score the request, pick the pool, overflow under pressure, record why.

Routing settings live in Redis (`sy:routing`, with a version number and an audit list).
Every gateway replica re-reads them when the version changes (it polls the version every
`routing_poll_s`), so an admin change applies everywhere within a second, no restart.
"""

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from cascade.classifier import DifficultyScorer
from cascade.policy import (
    InvalidRouting,
    RoutingSettings,
    budget_threshold,
    effective_threshold,
    route,
    settings_from_dict,
    settings_to_dict,
    should_overflow,
)

log = logging.getLogger(__name__)

SETTINGS_KEY = "sy:routing"
AUDIT_KEY = "sy:routing:audit"
AUDIT_LEN = 1000


@dataclass
class Decision:
    """Where an `auto` request goes and why (the x-switchyard-* headers)."""

    pool: str
    route: str  # classifier | overflow | fallback (escalated is decided after the answer)
    score: float | None
    threshold: float | None
    structured: bool = False  # the request had tools or a JSON schema


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "switchyard_cascade_"
        self.decisions = Counter(
            p + "decisions", "Auto-routing decisions.", ["pool", "route"], registry=registry
        )
        self.escalations = Counter(
            p + "escalations",
            "Small answers re-run on the large pool.",
            ["changed"],
            registry=registry,
        )
        self.failures = Counter(
            p + "classifier_failures", "Scoring errors (default pool used).", registry=registry
        )
        self.fallback_scorer = Counter(
            p + "fallback_scorer_loads",
            "Classifier artifact could not load; length heuristic used.",
            registry=registry,
        )
        self.score = Histogram(
            p + "score",
            "Difficulty scores of auto requests.",
            buckets=[i / 10 for i in range(1, 11)],
            registry=registry,
        )
        self.latency = Histogram(
            p + "classifier_latency_seconds",
            "Time to score one request.",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
            registry=registry,
        )


class Router:
    """The cascade as the gateway uses it: settings (refreshed from Redis) plus a scorer."""

    def __init__(
        self,
        redis: Any,
        scorer: DifficultyScorer,
        reference_scores: Sequence[float],
        small_pool: str,
        large_pool: str,
        metrics: RoutingMetrics,
        poll_s: float = 0.5,
        classifiers: Any = None,
        no_logprobs: Callable[[], str | None] | None = None,
    ) -> None:
        """`classifiers`: a `gateway.learning.classifiers.ClassifierRegistry` of per-tenant scorers
        (None: every tenant is scored by `scorer`)."""
        self.redis = redis
        self.scorer = scorer
        self.reference_scores = list(reference_scores)
        self.small_pool = small_pool
        self.large_pool = large_pool
        self.metrics = metrics
        self.poll_s = poll_s
        self.settings = RoutingSettings()
        self.classifiers = classifiers
        # Why the small pool's answers carry no logprobs now (its kind of server, configured
        # or detected, gives none), so escalation cannot work and settings enabling it are
        # refused; None: they do.
        self.no_logprobs = no_logprobs or (lambda: None)
        self._checked_at = 0.0

    def scorer_for(self, tenant_id: str) -> tuple[DifficultyScorer, Sequence[float]]:
        """The tenant's promoted classifier and its reference scores, else the default."""
        own = self.classifiers.scorer_for(tenant_id) if self.classifiers is not None else None
        return own if own is not None else (self.scorer, self.reference_scores)

    async def refresh(self, force: bool = False) -> RoutingSettings:
        """Re-read the settings if their version changed (at most every poll_s)."""
        now = time.monotonic()
        if not force and now - self._checked_at < self.poll_s:
            return self.settings
        self._checked_at = now
        try:
            if self.classifiers is not None:
                await self.classifiers.refresh()
            raw = await self.redis.get(SETTINGS_KEY)
        except Exception as exc:  # keep routing on the last settings we had
            log.warning(
                "routing settings unavailable, keeping version %d: %r", self.settings.version, exc
            )
            return self.settings
        if raw is not None:
            doc = json.loads(raw)
            if doc.get("version", 0) != self.settings.version:
                self.settings = settings_from_dict(doc, None)
                log.info("routing settings version %d applied", self.settings.version)
        return self.settings

    async def update(
        self, raw: dict[str, Any], known_tenants: set[str], who: str
    ) -> RoutingSettings:
        """Validate and store new settings (version + 1) with an audit entry."""
        current = await self.refresh(force=True)
        new = settings_from_dict({**raw, "version": current.version + 1}, known_tenants)
        enabling = sorted(t for t, e in new.escalation.items() if e.enabled)
        why = self.no_logprobs() if enabling else None
        if why is not None:
            raise InvalidRouting(
                f"escalation needs the small pool's token logprobs, and {why}",
                f"escalation.{enabling[0]}.enabled",
            )
        doc = settings_to_dict(new)
        entry = {"who": who, "when": time.time(), "old": settings_to_dict(current), "new": doc}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(SETTINGS_KEY, json.dumps(doc))
            pipe.lpush(AUDIT_KEY, json.dumps(entry))
            pipe.ltrim(AUDIT_KEY, 0, AUDIT_LEN - 1)
            await pipe.execute()
        self.settings = new
        log.info("routing settings version %d stored by %s", new.version, who)
        return new

    async def audit(self, limit: int = 50) -> list[dict[str, Any]]:
        return [json.loads(x) for x in await self.redis.lrange(AUDIT_KEY, 0, limit - 1)]

    def decide(
        self,
        tenant_id: str,
        allow_overflow: bool,
        prompt: str,
        messages: list[dict] | None,
        max_tokens: int | None,
        large_wait_s: float,
        large_pressed: bool,
        request_threshold: float | None = None,
        key_threshold: float | None = None,
        structured: bool = False,
        spend_fraction: float | None = None,
    ) -> Decision:
        """`structured`: the request's output is constrained (tools, a JSON schema); a flag
        carried to the decision and the debug log (the classifier is not trained on it).
        `spend_fraction`: the tenant's spend over its budget's spend target (None: none),
        which raises the threshold as it nears 1 (`cascade.policy.budget_threshold`)."""
        s = self.settings
        scorer, reference = self.scorer_for(tenant_id)
        t0 = time.perf_counter()
        try:
            score = scorer.score(prompt, messages, max_tokens)
        except Exception:
            log.exception("classifier failed; routing to %s", self.small_pool)
            self.metrics.failures.inc()
            self.metrics.decisions.labels(self.small_pool, "fallback").inc()
            return Decision(self.small_pool, "fallback", None, None)
        self.metrics.latency.observe(time.perf_counter() - t0)
        self.metrics.score.observe(score)
        threshold = effective_threshold(
            s,
            tenant_id,
            reference,
            key_threshold=key_threshold,
            request_threshold=request_threshold,
        )
        threshold = budget_threshold(threshold, spend_fraction)
        pool = self.large_pool if route(score, threshold) == "large" else self.small_pool
        reason = "classifier"
        if pool == self.large_pool and should_overflow(
            large_wait_s, large_pressed, s.overflow_max_wait_s, allow_overflow
        ):
            pool, reason = self.small_pool, "overflow"
        if log.isEnabledFor(logging.DEBUG):
            top = scorer.explain(prompt, messages, max_tokens, top=5)
            log.debug(
                "auto: score %.3f threshold %.3f -> %s (%s, structured %s); top features %s",
                score,
                threshold,
                pool,
                reason,
                structured,
                top,
            )
        self.metrics.decisions.labels(pool, reason).inc()
        return Decision(pool, reason, score, threshold, structured)
