"""Money on the request path: what a plan reserves, what the cascade is told of a tenant's
spend, and the soft-budget webhook. The arithmetic is `gateway.billing.prices` and
`quota.budget`; the counting is reserve.lua's and reconcile.lua's.
"""

import logging
from collections.abc import Mapping
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from gateway.billing.prices import PoolPrice, worst_case_nanos
from quota.budget import Budget, budget_state

log = logging.getLogger(__name__)

_SEEN_MAX = 100_000  # tenants whose last spend this process remembers


def plan_worst_case_nanos(
    prices: Mapping[str, PoolPrice],
    pool: str,
    prompt_tokens: int,
    max_tokens: int,
    n: int,
    escalation_pool: str | None,
) -> int:
    """What a planned request reserves: its worst case on its pool, plus on the pool an
    unsure answer escalates to (an escalated request is charged both attempts)."""
    cost = worst_case_nanos(prices.get(pool), prompt_tokens, max_tokens, n)
    if escalation_pool is not None:
        cost += worst_case_nanos(prices.get(escalation_pool), prompt_tokens, max_tokens, n)
    return cost


class SpendView:
    """What this gateway last saw of each tenant's spend in its budget's period (from each
    reservation's reply), for the cascade's budget policy: one request stale at most per
    gateway, no Redis round trip of its own."""

    def __init__(self) -> None:
        self._spent: dict[str, int] = {}

    def note(self, holder_id: str, spent_nanos: int) -> None:
        if len(self._spent) >= _SEEN_MAX and holder_id not in self._spent:
            self._spent.clear()
        self._spent[holder_id] = spent_nanos

    def fraction_of_target(self, holder_id: str, budget: Budget | None) -> float | None:
        """Spend over the budget's spend target (None: no target set)."""
        if budget is None or not budget.spend_target_nanos:
            return None
        return self._spent.get(holder_id, 0) / budget.spend_target_nanos


class BudgetWebhook:
    """POSTs a soft-budget crossing to the operator's URL (JSON: tenant, key, period, spent,
    soft, hard, currency, time), off the request path, retried 3 times with backoff; a
    failure is logged and counted, never the request's."""

    def __init__(self, url: str | None, currency: str, timeout_s: float = 5.0) -> None:
        self.url = url
        self.currency = currency
        self._client = httpx.AsyncClient(timeout=timeout_s) if url else None
        self.failures = 0
        self.sent = 0

    def payload(
        self,
        holder: str,
        tenant_id: str,
        key_id: str | None,
        budget: Budget,
        spent_nanos: int,
        now_s: float,
    ) -> dict[str, Any]:
        state = budget_state(budget, spent_nanos, now_s)
        return {
            "event": "budget.soft_threshold_crossed",
            "holder": holder,
            "tenant_id": tenant_id,
            "key_id": key_id,
            "currency": self.currency,
            "time": now_s,
            **state,
        }

    async def send(self, payload: dict[str, Any]) -> None:
        if self._client is None:
            return
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(3),
                wait=wait_exponential(multiplier=0.2, max=2.0),
                retry=retry_if_exception_type(httpx.HTTPError),
                reraise=True,
            ):
                with attempt:
                    r = await self._client.post(self.url, json=payload)  # type: ignore[arg-type]
                    r.raise_for_status()
            self.sent += 1
        except (TimeoutError, httpx.HTTPError) as exc:
            self.failures += 1
            log.warning(
                "budget webhook to %s failed for %s: %r", self.url, payload.get("tenant_id"), exc
            )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
