"""QuotaLimiter against a real Redis: reserve, reconcile and usage."""

from pathlib import Path

import pytest
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError

from quota import keyspace
from quota.errors import QuotaExceeded, QuotaUnavailable
from quota.journal import ReconcileJournal, journal_path
from quota.limiter import FailurePolicy, QuotaLimiter, Reservation
from quota.models import Tenant, TenantLimits
from quota.policy import windows_at

pytestmark = pytest.mark.asyncio


def tenant(tenant_id: str = "acme", **limits: int) -> Tenant:
    return Tenant(tenant_id, tenant_id.title(), TenantLimits(**limits), [])


@pytest.fixture
def limiter(redis_client: redis.asyncio.Redis) -> QuotaLimiter:
    return QuotaLimiter(redis_client)


async def server_minute(client: redis.asyncio.Redis) -> int:
    sec, usec = await client.time()
    return windows_at(sec + usec / 1e6).minute


async def test_reserve_under_the_limits_charges_every_window(limiter: QuotaLimiter) -> None:
    t = tenant(tokens_per_minute=1000, tokens_per_day=5000, requests_per_minute=10)
    reservation, state = await limiter.reserve(t, "r1", 100)
    assert reservation.checked and reservation.tokens == 100
    assert (state.limit_tokens, state.remaining_tokens) == (1000, 900)
    assert (state.limit_requests, state.remaining_requests) == (10, 9)
    assert 0 < state.reset_tokens_s <= 60 and state.reset_requests_s == state.reset_tokens_s
    usage = await limiter.usage("acme")
    assert usage == {
        "tokens_this_minute": 100,
        "tokens_today": 100,
        "requests_this_minute": 1,
        "concurrent_requests": 0,  # no max_concurrent: no concurrency accounting
    }


async def test_unlimited_tenant_is_admitted_with_empty_state_but_still_counted(
    limiter: QuotaLimiter,
) -> None:
    _, state = await limiter.reserve(tenant(), "r1", 10**9)
    assert state.limit_tokens is None and state.remaining_tokens is None
    assert state.limit_requests is None and state.reset_requests_s is None
    assert (await limiter.usage("acme"))["tokens_today"] == 10**9


async def test_over_the_minute_window_is_rate_limited_until_the_minute_ends(
    limiter: QuotaLimiter,
) -> None:
    t = tenant(tokens_per_minute=1000)
    await limiter.reserve(t, "r1", 600)
    with pytest.raises(QuotaExceeded) as err:
        await limiter.reserve(t, "r2", 500)
    e = err.value
    assert (e.kind, e.code, e.limit, e.remaining) == (
        "tokens_per_minute",
        "rate_limit_exceeded",
        1000,
        400,
    )
    assert 0 < e.retry_after_s <= 60
    await limiter.reserve(t, "r3", 400)  # exactly the rest still fits
    assert (await limiter.usage("acme"))["tokens_this_minute"] == 1000


async def test_over_the_day_budget_is_insufficient_quota(limiter: QuotaLimiter) -> None:
    t = tenant(tokens_per_minute=10_000, tokens_per_day=500)
    await limiter.reserve(t, "r1", 400)
    with pytest.raises(QuotaExceeded) as err:
        await limiter.reserve(t, "r2", 200)
    assert (err.value.kind, err.value.code) == ("tokens_per_day", "insufficient_quota")
    assert 0 < err.value.retry_after_s <= 86_400
    assert err.value.remaining == 100


async def test_requests_per_minute_limit(limiter: QuotaLimiter) -> None:
    t = tenant(requests_per_minute=2)
    await limiter.reserve(t, "r1", 1)
    await limiter.reserve(t, "r2", 1)
    with pytest.raises(QuotaExceeded) as err:
        await limiter.reserve(t, "r3", 1)
    assert (err.value.kind, err.value.code) == ("requests_per_minute", "rate_limit_exceeded")
    assert (err.value.limit, err.value.remaining) == (2, 0)


async def test_concurrency_limit_refuses_until_a_slot_is_released(limiter: QuotaLimiter) -> None:
    t = tenant(max_concurrent=2)
    first, _ = await limiter.reserve(t, "r1", 10)
    await limiter.reserve(t, "r2", 10)
    assert (await limiter.usage("acme"))["concurrent_requests"] == 2
    with pytest.raises(QuotaExceeded) as err:
        await limiter.reserve(t, "r3", 10)
    assert (err.value.kind, err.value.code) == ("concurrency", "rate_limit_exceeded")
    assert 0 < err.value.retry_after_s <= 2
    await limiter.reconcile(first, 10)
    assert (await limiter.usage("acme"))["concurrent_requests"] == 1
    await limiter.reserve(t, "r3", 10)


async def test_expired_concurrency_leases_free_their_slots(
    limiter: QuotaLimiter, redis_client: redis.asyncio.Redis
) -> None:
    t = tenant(max_concurrent=1)
    await limiter.reserve(t, "crashed", 10)
    with pytest.raises(QuotaExceeded):
        await limiter.reserve(t, "r2", 10)
    # The gateway holding "crashed" died: its lease ends (score = lease end, server ms).
    await redis_client.zadd(keyspace.concurrency("acme"), {"crashed": 1})
    await limiter.reserve(t, "r2", 10)
    assert await redis_client.zrange(keyspace.concurrency("acme"), 0, -1) == [b"r2"]


async def test_refused_reserve_charges_nothing(limiter: QuotaLimiter) -> None:
    t = tenant(tokens_per_minute=1000, requests_per_minute=100, max_concurrent=1)
    await limiter.reserve(t, "r1", 100)
    before = await limiter.usage("acme")
    with pytest.raises(QuotaExceeded) as err:  # tokens would fit; concurrency does not
        await limiter.reserve(t, "r2", 100)
    assert err.value.kind == "concurrency"
    assert await limiter.usage("acme") == before

    other = tenant("beta", tokens_per_minute=100, max_concurrent=5)
    with pytest.raises(QuotaExceeded) as err:  # a slot is free; tokens do not fit
        await limiter.reserve(other, "b1", 101)
    assert err.value.kind == "tokens_per_minute"
    assert await limiter.usage("beta") == dict.fromkeys(before, 0)


async def test_most_binding_limit_is_reported_when_several_refuse(limiter: QuotaLimiter) -> None:
    t = tenant(tokens_per_minute=100, tokens_per_day=100, max_concurrent=1)
    await limiter.reserve(t, "r1", 100)
    with pytest.raises(QuotaExceeded) as err:
        await limiter.reserve(t, "r2", 1)
    assert err.value.kind == "tokens_per_day"


async def test_reconcile_adjusts_down_and_up_and_releases_the_slot(limiter: QuotaLimiter) -> None:
    t = tenant(tokens_per_minute=10_000, max_concurrent=2)
    a, _ = await limiter.reserve(t, "a", 500)
    b, _ = await limiter.reserve(t, "b", 100)
    await limiter.reconcile(a, 200)  # used less than reserved
    await limiter.reconcile(b, 300)  # used more (e.g. max_tokens underestimated)
    usage = await limiter.usage("acme")
    assert (usage["tokens_this_minute"], usage["tokens_today"]) == (500, 500)
    assert usage["concurrent_requests"] == 0
    assert usage["requests_this_minute"] == 2


async def test_reconcile_is_idempotent(limiter: QuotaLimiter) -> None:
    t = tenant(max_concurrent=5)
    r, _ = await limiter.reserve(t, "a", 500)
    await limiter.reconcile(r, 100)
    await limiter.reconcile(r, 100)
    # A copy of the reservation (e.g. one that crossed a process boundary) is refused by Redis.
    copy = Reservation(**{**r.__dict__, "reconciled": False})
    await limiter.reconcile(copy, 0)
    assert (await limiter.usage("acme"))["tokens_today"] == 100


async def test_reconcile_clamps_counters_at_zero(
    limiter: QuotaLimiter, redis_client: redis.asyncio.Redis
) -> None:
    r, _ = await limiter.reserve(tenant(), "a", 500)
    await redis_client.set(keyspace.tokens_minute("acme", r.minute), 50, keepttl=True)
    await limiter.reconcile(r, 0)
    assert int(await redis_client.get(keyspace.tokens_minute("acme", r.minute))) == 0
    assert int(await redis_client.get(keyspace.tokens_day("acme", r.day))) == 0


async def test_reconcile_after_the_minute_rolled_adjusts_the_old_window(
    limiter: QuotaLimiter, redis_client: redis.asyncio.Redis
) -> None:
    t = tenant(tokens_per_minute=1000)
    old, _ = await limiter.reserve(t, "old", 400)
    # Pretend "old" was reserved a minute earlier: move its charge to the previous window.
    previous = old.minute - 1
    await redis_client.rename(
        keyspace.tokens_minute("acme", old.minute), keyspace.tokens_minute("acme", previous)
    )
    old.minute = previous
    new, _ = await limiter.reserve(t, "new", 300)
    assert new.minute > previous

    await limiter.reconcile(old, 100)
    assert int(await redis_client.get(keyspace.tokens_minute("acme", previous))) == 100
    assert int(await redis_client.get(keyspace.tokens_minute("acme", new.minute))) == 300
    assert (await limiter.usage("acme"))["tokens_today"] == 400


async def test_windows_come_from_the_server_clock_not_the_local_one(
    redis_client: redis.asyncio.Redis,
) -> None:
    for skew_s in (-3600.0, 7200.0):
        limiter = QuotaLimiter(redis_client, clock=lambda s=skew_s: 1.8e9 + s)
        r, _ = await limiter.reserve(tenant(tokens_per_minute=100), f"r{skew_s}", 10)
        assert r.minute == await server_minute(redis_client)
    assert (await limiter.usage("acme"))["tokens_this_minute"] == 20


async def test_negative_tokens_are_a_bug(limiter: QuotaLimiter) -> None:
    with pytest.raises(ValueError):
        await limiter.reserve(tenant(), "r", -1)


async def test_a_repeated_reserve_charges_once_and_reports_the_first_windows(
    limiter: QuotaLimiter, redis_client: redis.asyncio.Redis
) -> None:
    t = tenant(tokens_per_minute=1000, max_concurrent=5)
    first, _ = await limiter.reserve(t, "r1", 100)
    await redis_client.rename(  # as if the first call happened a minute earlier
        keyspace.tokens_minute("acme", first.minute), keyspace.tokens_minute("acme", 7)
    )
    await redis_client.hset(keyspace.pending("acme", "r1"), "minute", 7)
    again, _ = await limiter.reserve(t, "r1", 100)  # a retry after a lost reply
    assert (again.minute, again.day) == (7, first.day)
    usage = await limiter.usage("acme")
    assert (usage["tokens_today"], usage["requests_this_minute"]) == (100, 1)
    await limiter.reconcile(again, 40)
    assert int(await redis_client.get(keyspace.tokens_minute("acme", 7))) == 40


async def test_unchecked_reconcile_of_a_reserve_whose_reply_was_lost_charges_once(
    limiter: QuotaLimiter,
) -> None:
    t = tenant(max_concurrent=5)
    await limiter.reserve(t, "r1", 100)  # Redis charged it; the gateway never heard back
    lost = Reservation("acme", "r1", 100, checked=False)  # so it admitted it unchecked
    await limiter.reconcile(lost, 30)
    await limiter.reconcile(Reservation("acme", "r1", 100, checked=False), 30)
    usage = await limiter.usage("acme")
    assert (usage["tokens_today"], usage["concurrent_requests"]) == (30, 0)


async def test_a_refusal_after_a_lost_reserve_reply_voids_the_reservation_once_redis_is_back(
    redis_client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """Fail closed: Redis ran reserve.lua and went away before replying. The gateway refuses
    (503), and the reservation Redis kept must not stay charged or hold its slot: the
    journaled void settles it when applied, and applying it again does nothing."""
    journal = ReconcileJournal(journal_path(tmp_path, "gw1"))
    closed = FailurePolicy(tokens="closed", requests="closed", concurrency="closed")
    limiter = QuotaLimiter(redis_client, closed, owner_id="gw1", journal=journal)
    real_reserve = limiter.scripts.reserve

    async def reply_lost(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        await real_reserve(*args, **kwargs)
        raise RedisConnectionError("Connection closed by server.")

    limiter.scripts.reserve = reply_lost  # type: ignore[method-assign]
    t = tenant(tokens_per_day=1000, max_concurrent=2)
    with pytest.raises(QuotaUnavailable):
        await limiter.reserve(t, "r1", 100)
    assert (await limiter.usage("acme"))["concurrent_requests"] == 1  # Redis kept it

    [void] = journal.outstanding()
    assert (void.request_id, void.checked, void.delta_tokens) == ("r1", False, 0)
    assert await limiter.scripts.settle(void)
    assert not await limiter.scripts.settle(void)
    usage = await limiter.usage("acme")
    assert (usage["tokens_today"], usage["concurrent_requests"]) == (0, 0)
    journal.close()


async def test_a_refusal_with_no_reserve_run_voids_nothing(
    redis_client: redis.asyncio.Redis, tmp_path: Path
) -> None:
    journal = ReconcileJournal(journal_path(tmp_path, "gw1"))
    closed = FailurePolicy(tokens="closed", requests="closed", concurrency="closed")
    limiter = QuotaLimiter(redis_client, closed, owner_id="gw1", journal=journal)
    await limiter.reserve(tenant(), "other", 70)

    async def unreachable(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RedisConnectionError("Error 111 connecting. Connection refused.")

    limiter.scripts.reserve = unreachable  # type: ignore[method-assign]
    with pytest.raises(QuotaUnavailable):
        await limiter.reserve(tenant(tokens_per_day=1000), "r1", 100)
    [void] = journal.outstanding()
    assert await limiter.scripts.settle(void)  # applied, charging nothing
    assert (await limiter.usage("acme"))["tokens_today"] == 70
    journal.close()
