"""TenantStore against a real Redis: tenant CRUD, validation, API keys."""

import pytest
import redis.asyncio

from quota.errors import InvalidLimits, TenantExists, TenantNotFound
from quota.models import TenantLimits
from quota.store import TenantStore

pytestmark = pytest.mark.asyncio


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(redis_client: redis.asyncio.Redis, clock: FakeClock) -> TenantStore:
    return TenantStore(redis_client, clock=clock)


async def test_create_get_list_update_delete_tenant_round_trips(store: TenantStore) -> None:
    limits = TenantLimits(tokens_per_minute=1000, max_concurrent=4)
    created = await store.create_tenant("acme", "Acme", limits, ["small"], allow_overflow=False)
    assert created.created_at == 1_000_000.0
    assert await store.get_tenant("acme") == created
    await store.create_tenant("beta", "Beta", TenantLimits())
    assert [t.tenant_id for t in await store.list_tenants()] == ["acme", "beta"]

    updated = await store.update_tenant(
        "acme", name="Acme Inc", limits=TenantLimits(tokens_per_day=10), allowed_models=[]
    )
    assert updated.name == "Acme Inc"
    assert updated.limits == TenantLimits(tokens_per_day=10)  # limits replaced as a whole
    assert updated.allowed_models == [] and updated.allow_overflow is False  # kept
    assert await store.get_tenant("acme") == updated

    assert await store.delete_tenant("acme") is True
    assert await store.get_tenant("acme") is None
    assert await store.delete_tenant("acme") is False
    assert [t.tenant_id for t in await store.list_tenants()] == ["beta"]


async def test_duplicate_tenant_raises_tenant_exists(store: TenantStore) -> None:
    await store.create_tenant("acme", "Acme", TenantLimits())
    with pytest.raises(TenantExists):
        await store.create_tenant("acme", "Other", TenantLimits())
    assert (await store.get_tenant("acme")).name == "Acme"


async def test_unknown_tenant_raises_tenant_not_found(store: TenantStore) -> None:
    with pytest.raises(TenantNotFound) as err:
        await store.update_tenant("ghost", name="x")
    assert err.value.tenant_id == "ghost"
    with pytest.raises(TenantNotFound):
        await store.create_key("ghost")
    with pytest.raises(TenantNotFound):
        await store.list_keys("ghost")
    assert await store.get_tenant("no/such id") is None


@pytest.mark.parametrize(
    ("tenant_id", "limits", "param"),
    [
        ("bad id!", TenantLimits(), "tenant_id"),
        ("x" * 65, TenantLimits(), "tenant_id"),
        ("", TenantLimits(), "tenant_id"),
        ("ok", TenantLimits(tokens_per_minute=0), "limits.tokens_per_minute"),
        ("ok", TenantLimits(max_concurrent=-1), "limits.max_concurrent"),
        ("ok", TenantLimits(max_context=True), "limits.max_context"),
    ],
)
async def test_invalid_tenant_id_or_limits_raise_invalid_limits_and_store_nothing(
    store: TenantStore, tenant_id: str, limits: TenantLimits, param: str
) -> None:
    with pytest.raises(InvalidLimits) as err:
        await store.create_tenant(tenant_id, "n", limits)
    assert err.value.param == param
    assert await store.list_tenants() == []


async def test_update_with_invalid_limits_keeps_the_old_ones(store: TenantStore) -> None:
    await store.create_tenant("acme", "Acme", TenantLimits(tokens_per_minute=5))
    with pytest.raises(InvalidLimits):
        await store.update_tenant("acme", limits=TenantLimits(tokens_per_day=0))
    assert (await store.get_tenant("acme")).limits.tokens_per_minute == 5


async def test_issued_key_authenticates_to_its_tenant(store: TenantStore) -> None:
    tenant = await store.create_tenant("acme", "Acme", TenantLimits())
    issued = await store.create_key("acme", name="ci")
    assert issued.plaintext.startswith(issued.record.prefix + "-")
    assert issued.record.prefix == f"sy-{issued.record.key_id}"
    record, found = await store.authenticate(issued.plaintext)
    assert record == issued.record and found == tenant
    assert await store.list_keys("acme") == [issued.record]


async def test_wrong_or_malformed_keys_do_not_authenticate(store: TenantStore) -> None:
    await store.create_tenant("acme", "Acme", TenantLimits())
    issued = await store.create_key("acme")
    tampered = issued.plaintext[:-1] + ("A" if issued.plaintext[-1] != "A" else "B")
    other_id = "sy-00000000-" + issued.plaintext.split("-", 2)[2]
    for bad in [tampered, other_id, "", "sy-", "Bearer x", issued.record.prefix, "sy-zz-yy"]:
        assert await store.authenticate(bad) is None, bad


async def test_plaintext_is_never_stored(
    store: TenantStore, redis_client: redis.asyncio.Redis
) -> None:
    await store.create_tenant("acme", "Acme", TenantLimits())
    issued = await store.create_key("acme", name="ci")
    secret = issued.plaintext.split("-", 2)[2].encode()
    keys = [k async for k in redis_client.scan_iter("*")]
    assert keys
    for key in keys:
        assert secret not in key
        kind = await redis_client.type(key)
        if kind == b"string":
            values = [await redis_client.get(key)]
        elif kind == b"set":
            values = list(await redis_client.smembers(key))
        else:
            values = [str(await redis_client.dump(key)).encode()]
        assert all(secret not in v for v in values), key


async def test_revoked_key_stops_authenticating_on_the_next_call(store: TenantStore) -> None:
    await store.create_tenant("acme", "Acme", TenantLimits())
    keep, drop = await store.create_key("acme"), await store.create_key("acme")
    assert await store.authenticate(drop.plaintext) is not None
    assert await store.revoke_key(drop.record.key_id) is True
    assert await store.authenticate(drop.plaintext) is None
    assert await store.authenticate(keep.plaintext) is not None
    listed = {k.key_id: k.revoked for k in await store.list_keys("acme")}
    assert listed == {keep.record.key_id: False, drop.record.key_id: True}
    assert await store.revoke_key("deadbeef") is False


async def test_key_expires_at_its_expiry_time(store: TenantStore, clock: FakeClock) -> None:
    await store.create_tenant("acme", "Acme", TenantLimits())
    issued = await store.create_key("acme", expires_at=clock.now + 60)
    clock.now += 59.9
    assert await store.authenticate(issued.plaintext) is not None
    clock.now += 0.1
    assert await store.authenticate(issued.plaintext) is None


async def test_deleting_a_tenant_revokes_its_keys_even_if_the_id_is_reused(
    store: TenantStore,
) -> None:
    await store.create_tenant("acme", "Acme", TenantLimits())
    issued = await store.create_key("acme")
    assert await store.delete_tenant("acme")
    assert await store.authenticate(issued.plaintext) is None
    await store.create_tenant("acme", "Acme again", TenantLimits())
    assert await store.authenticate(issued.plaintext) is None
    assert await store.list_keys("acme") == []


@pytest.mark.parametrize("tenant_id", ["key.abc123", "KEY.abc123", "key."])
async def test_tenant_ids_in_the_key_quota_namespace_are_refused(
    store: TenantStore, redis_client: redis.asyncio.Redis, tenant_id: str
) -> None:
    """A tenant named like a key's own quota holder would see and drive that key's counters."""
    with pytest.raises(InvalidLimits) as err:
        await store.create_tenant(tenant_id, "x", TenantLimits())
    assert err.value.param == "tenant_id" and "key." in str(err.value)
    assert await redis_client.keys("*") == []


async def test_a_deleted_tenant_takes_its_counters_usage_and_log_with_it(
    store: TenantStore, redis_client: redis.asyncio.Redis, tmp_path
) -> None:
    from quota.journal import ReconcileJournal, journal_path
    from quota.limiter import QuotaLimiter
    from quota.usage import UsageConfig, UsagePart, UsageReader, choose_range, usage_record

    config = UsageConfig()
    tenant = await store.create_tenant("acme", "Acme", TenantLimits(tokens_per_minute=10_000))
    issued = await store.create_key("acme", limits=TenantLimits(tokens_per_minute=500))
    journal = ReconcileJournal(journal_path(tmp_path, "gw"))
    limiter = QuotaLimiter(redis_client, owner_id="gw", journal=journal, usage=config)
    res, _ = await limiter.reserve(tenant, "r1", 100)
    record = usage_record(
        request_id="r1",
        key_id=issued.record.key_id,
        model="small",
        route="forced",
        status=200,
        latency_ms=10,
        parts=[UsagePart("small", 10, 0, 5)],
        finished_at_s=1_000_000.0,
    )
    await limiter.reconcile(res, 15, record)
    reader = UsageReader(redis_client, config)
    assert await reader.recent("acme")
    prefix = "sy:{acme}:*"
    assert await redis_client.keys(prefix)

    assert await store.delete_tenant("acme")
    assert await redis_client.keys(prefix) == []
    await store.create_tenant("acme", "Someone else", TenantLimits())
    assert await reader.recent("acme") == []
    rng = choose_range(999_000.0, 1_001_000.0, "day", 1_001_000.0, config)
    assert await reader.query("acme", rng, "day") == []
    assert set(await redis_client.keys(prefix)) == {b"sy:{acme}:tenant"}


@pytest.mark.parametrize("expires_at", [999_995.0, 1_000_000.0, float("nan"), float("inf")])
async def test_a_key_expired_at_creation_or_with_no_real_expiry_is_refused(
    store: TenantStore, clock: FakeClock, expires_at: float
) -> None:
    """`switchyard admin create-key --expires-in -5` made a key that never worked."""
    await store.create_tenant("acme", "Acme", TenantLimits())
    with pytest.raises(InvalidLimits) as err:
        await store.create_key("acme", expires_at=expires_at)
    assert err.value.param == "expires_at"
    assert await store.list_keys("acme") == []


@pytest.mark.parametrize("value", [10**30, 2**53 + 1])
async def test_limits_past_what_a_counter_holds_exactly_are_refused(
    store: TenantStore, value: int
) -> None:
    with pytest.raises(InvalidLimits) as err:
        await store.create_tenant("acme", "Acme", TenantLimits(tokens_per_day=value))
    assert err.value.param == "limits.tokens_per_day"
    await store.create_tenant("acme", "Acme", TenantLimits(tokens_per_day=2**53))
