"""Money budgets against a real Redis: reserved at the worst case, refused past the hard
budget (nothing charged), corrected to the real cost, a soft crossing said once a period,
a rolling window read from its days, and a refund when a reservation is given back."""

import asyncio

import pytest
import redis.asyncio

from quota import keyspace
from quota.budget import NANOS, Budget, month_of_day, spend_windows
from quota.errors import BudgetExceeded
from quota.limiter import QuotaLimiter
from quota.models import Tenant, TenantLimits
from quota.policy import windows_at

pytestmark = pytest.mark.asyncio


def tenant(budget: Budget | None, tenant_id: str = "acme") -> Tenant:
    return Tenant(tenant_id, tenant_id, TenantLimits(), [], budget=budget)


@pytest.fixture
def limiter(redis_client: redis.asyncio.Redis) -> QuotaLimiter:
    return QuotaLimiter(redis_client)


async def today(client: redis.asyncio.Redis) -> int:
    sec, usec = await client.time()
    return windows_at(sec + usec / 1e6).day


async def test_a_request_past_the_hard_budget_is_refused_and_charged_nothing(
    limiter: QuotaLimiter, redis_client: redis.asyncio.Redis
) -> None:
    t = tenant(Budget("month", hard_nanos=1000))
    first, _ = await limiter.reserve(t, "r1", 10, cost_nanos=600)
    assert first.spent_nanos == 600
    with pytest.raises(BudgetExceeded) as err:
        await limiter.reserve(t, "r2", 10, cost_nanos=500)
    e = err.value
    assert (e.kind, e.code, e.limit, e.remaining, e.spent_nanos) == (
        "budget",
        "budget_exceeded",
        1000,
        400,
        600,
    )
    assert e.period == "month" and e.retry_after_s >= 1.0
    assert e.resets_at_s > 0
    spent, _ = await limiter.spent("acme", t.budget)  # type: ignore[arg-type]
    assert spent == 600  # the refused request left nothing behind
    assert (await limiter.usage("acme"))["tokens_today"] == 10


async def test_settling_corrects_spend_to_the_real_cost_and_a_release_refunds_it(
    limiter: QuotaLimiter,
) -> None:
    t = tenant(Budget("day", hard_nanos=10_000))
    r1, _ = await limiter.reserve(t, "r1", 10, cost_nanos=4000)
    r2, _ = await limiter.reserve(t, "r2", 10, cost_nanos=3000)
    await limiter.reconcile(r1, 8, actual_cost_nanos=1234)
    await limiter.reconcile(r2, 0)  # given back: nothing of its reservation stays
    spent, _ = await limiter.spent("acme", t.budget)  # type: ignore[arg-type]
    assert spent == 1234
    await limiter.reconcile(r1, 8, actual_cost_nanos=9999)  # settled once only
    assert (await limiter.spent("acme", t.budget))[0] == 1234  # type: ignore[arg-type]


async def test_spend_is_counted_without_a_budget_so_one_set_later_sees_it(
    limiter: QuotaLimiter,
) -> None:
    r, _ = await limiter.reserve(tenant(None), "r1", 10, cost_nanos=700)
    await limiter.reconcile(r, 10, actual_cost_nanos=500)
    later = tenant(Budget("month", hard_nanos=1000))
    assert (await limiter.spent("acme", later.budget))[0] == 500  # type: ignore[arg-type]
    with pytest.raises(BudgetExceeded):
        await limiter.reserve(later, "r2", 10, cost_nanos=501)
    await limiter.reserve(later, "r3", 10, cost_nanos=500)  # exactly to the budget: fits


async def test_the_soft_budget_is_crossed_once_per_period(limiter: QuotaLimiter) -> None:
    t = tenant(Budget("day", soft_nanos=1000, hard_nanos=5000))
    crossed = []
    for i in range(4):
        r, _ = await limiter.reserve(t, f"r{i}", 1, cost_nanos=400)
        crossed.append(r.soft_crossed)
    assert crossed == [False, False, True, False]  # 400, 800, 1200 (crossed), 1600


async def test_a_rolling_budget_sums_the_days_of_its_window(
    limiter: QuotaLimiter, redis_client: redis.asyncio.Redis
) -> None:
    day = await today(redis_client)
    # Spend on earlier days, as reserve.lua would have counted it then.
    await redis_client.set(keyspace.spend_day("acme", day - 2), 300)
    await redis_client.set(keyspace.spend_day("acme", day - 5), 5000)  # outside a 3-day window
    t = tenant(Budget("rolling", window_days=3, hard_nanos=1000))
    assert (await limiter.spent("acme", t.budget))[0] == 300  # type: ignore[arg-type]
    await limiter.reserve(t, "r1", 1, cost_nanos=700)  # 300 + 700 = the budget
    with pytest.raises(BudgetExceeded) as err:
        await limiter.reserve(t, "r2", 1, cost_nanos=1)
    assert err.value.period == "rolling"
    wide = tenant(Budget("rolling", window_days=7, hard_nanos=1000))
    with pytest.raises(BudgetExceeded):  # the 5000 of 5 days ago is inside 7 days
        await limiter.reserve(wide, "r3", 1, cost_nanos=1)


async def test_a_settlement_corrects_the_day_and_month_it_was_reserved_in(
    limiter: QuotaLimiter, redis_client: redis.asyncio.Redis
) -> None:
    """A reservation made yesterday and settled today corrects yesterday's counters (what
    its budget period read when it was admitted), not today's."""
    day = await today(redis_client)
    t = tenant(Budget("day", hard_nanos=10_000))
    r, _ = await limiter.reserve(t, "r1", 1, cost_nanos=900)
    assert r.day == day
    await limiter.reconcile(r, 1, actual_cost_nanos=100)
    assert int(await redis_client.get(keyspace.spend_day("acme", day))) == 100
    month = month_of_day(day)
    assert int(await redis_client.get(keyspace.spend_month("acme", month))) == 100
    assert spend_windows(day, Budget("rolling", window_days=2)).earlier_days == (day - 1,)


async def test_concurrent_reservations_never_pass_the_hard_budget(
    redis_client: redis.asyncio.Redis,
) -> None:
    """Two limiters (two gateways) on one Redis, 40 requests at once near the budget: what
    is admitted never exceeds it, since each reserves its worst case atomically."""
    a, b = QuotaLimiter(redis_client), QuotaLimiter(redis_client)
    t = tenant(Budget("month", hard_nanos=10 * NANOS // 1000))  # 0.01 units

    async def one(i: int) -> int:
        try:
            await (a if i % 2 else b).reserve(t, f"r{i}", 1, cost_nanos=NANOS // 1000 * 3 // 10)
            return 1
        except BudgetExceeded:
            return 0

    admitted = sum(await asyncio.gather(*(one(i) for i in range(40))))
    spent = (await a.spent("acme", t.budget))[0]  # type: ignore[arg-type]
    assert admitted == 33  # floor(10 / 0.3)
    assert spent == admitted * (NANOS // 1000 * 3 // 10) <= t.budget.hard_nanos  # type: ignore[union-attr,operator]


async def test_a_day_budget_starts_afresh_each_utc_day(
    limiter: QuotaLimiter, redis_client: redis.asyncio.Redis
) -> None:
    """Yesterday's spend (its counter still kept, for rolling windows) is not today's: the
    day rolled over, the budget is whole again; the month's counter is a month budget's."""
    day = await today(redis_client)
    await redis_client.set(keyspace.spend_day("acme", day - 1), 10_000)
    t = tenant(Budget("day", hard_nanos=1000))
    r, _ = await limiter.reserve(t, "r1", 1, cost_nanos=1000)
    assert r.spent_nanos == 1000
    await redis_client.set(keyspace.spend_month("acme", month_of_day(day)), 10_000)
    with pytest.raises(BudgetExceeded):
        await limiter.reserve(tenant(Budget("month", hard_nanos=1000)), "r2", 1, 1)
