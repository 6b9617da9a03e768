"""Reconciling a pool with the fleet's membership as read (gateway/capacity/membership.py):
who is added, who leaves and how (left or lost), who is refused for another model, and
what stays (static and local members). Pure: reads are built here, no Redis."""

import msgspec
import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

from gateway.capacity.fair_queue import QueueConfig
from gateway.capacity.membership import MembershipWatcher, plan_changes
from gateway.capacity.pool import Pool
from gateway.config import MembershipConfig
from workers.api.membership import (
    MAX_RECORD_BYTES,
    LiveMember,
    MemberRecord,
    PoolMembers,
    check_name,
    check_url,
    decode_record,
    encode_record,
    member_id_for,
    member_state,
)
from workers.api.membership_store import MembershipStore

FP = "m1-aaaa"
OTHER = "m1-bbbb"


def record(url: str, state: str = "ready", fingerprint: str = FP, **kw) -> MemberRecord:
    return MemberRecord(
        pool="small",
        member_id=member_id_for(url),
        url=url,
        model="smol",
        fingerprint=fingerprint,
        host_id="h1",
        state=state,  # type: ignore[arg-type]
        **kw,
    )


def read(*records: MemberRecord, fingerprint: str | None = FP) -> PoolMembers:
    return PoolMembers("small", 1_000, fingerprint, [LiveMember(r, 7_000) for r in records])


def test_live_members_are_added_and_static_or_local_ones_are_left_alone() -> None:
    members = read(record("http://a:1"), record("http://b:1", "starting"), record("http://c:1"))
    changes = plan_changes(members, joined={"http://a:1"}, others={"http://c:1"})
    assert changes.add == ["http://b:1"]  # a: already joined; c: from config, stays config
    assert changes.remove == [] and changes.refused == []


def test_draining_and_withdrawn_members_leave_and_vanished_ones_are_lost() -> None:
    members = read(record("http://a:1", "draining"), record("http://b:1", "withdrawn"))
    changes = plan_changes(members, joined={"http://a:1", "http://b:1", "http://c:1"}, others=set())
    # a and b left on purpose (their requests finish); c has no record at all: its
    # deadline passed without a heartbeat, so requests waiting on it are lost.
    assert changes.remove == [("http://a:1", False), ("http://b:1", False), ("http://c:1", True)]
    assert changes.add == []


def test_a_member_of_another_model_is_refused_and_a_pinned_model_overrides_redis() -> None:
    members = read(record("http://a:1"), record("http://b:1", fingerprint=OTHER))
    changes = plan_changes(members, joined=set(), others=set())
    assert changes.add == ["http://a:1"]
    assert [r.url for r in changes.refused] == ["http://b:1"]
    pinned = plan_changes(members, joined={"http://a:1"}, others=set(), pinned=OTHER)
    assert pinned.add == ["http://b:1"] and pinned.remove == [("http://a:1", False)]
    assert [r.url for r in pinned.refused] == ["http://a:1"]


def test_members_this_process_announced_itself_are_skipped() -> None:
    members = read(record("http://a:1", announcer="me"), record("http://b:1", announcer="other"))
    changes = plan_changes(members, joined=set(), others=set(), skip_announcer="me")
    assert changes.add == ["http://b:1"]


def test_a_draining_member_of_another_model_is_neither_added_nor_counted_as_refused() -> None:
    members = read(record("http://b:1", "draining", fingerprint=OTHER))
    assert plan_changes(members, joined=set(), others=set()).refused == []


def make_pool() -> Pool:
    return Pool("small", ["http://static:1"], None, QueueConfig(), 4)  # type: ignore[arg-type]


def test_a_members_origin_is_shown_and_config_or_local_wins_over_joined() -> None:
    pool = make_pool()
    pool.add_member("http://j:1", origin="joined")
    pool.add_member("http://j:1", origin="local")  # a local replica also announced
    pool.add_member("http://l:1", origin="local")
    pool.add_member("http://l:1", origin="joined")  # read back from Redis: stays local
    origins = {w["url"]: w["origin"] for w in pool.snapshot()}
    assert origins == {"http://static:1": "config", "http://j:1": "local", "http://l:1": "local"}
    pool.remove_member("http://l:1")
    assert "http://l:1" not in pool.origins


def watcher(pool: Pool, registry: CollectorRegistry, **cfg) -> MembershipWatcher:
    # The store's client never connects here: `apply` reconciles a read it is given.
    store = MembershipStore(redis.asyncio.Redis())
    return MembershipWatcher(
        store, {"small": pool}, MembershipConfig(enabled=True, **cfg), registry
    )


def test_the_watcher_reconciles_a_pool_and_counts_a_refusal_once() -> None:
    pool, registry = make_pool(), CollectorRegistry()
    w = watcher(pool, registry)
    bad = record("http://b:1", fingerprint=OTHER)
    w.apply("small", read(record("http://a:1"), bad))
    w.apply("small", read(record("http://a:1"), bad))  # read again: not counted again
    assert set(pool.views) == {"http://static:1", "http://a:1"}
    assert pool.origins["http://a:1"] == "joined"

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"switchyard_gateway_membership_{name}", labels)

    assert sample("refused_total", pool="small") == 1
    assert sample("changes_total", pool="small", change="joined") == 1
    w.apply("small", read())  # both gone: a is lost, the static member stays
    assert set(pool.views) == {"http://static:1"}
    assert sample("changes_total", pool="small", change="lost") == 1
    w.apply("small", read(bad))  # the refused member back after it had gone: counted anew
    assert sample("refused_total", pool="small") == 2
    assert w.pool_fingerprints["small"] == FP


def test_the_watcher_refuses_a_config_naming_pools_it_does_not_have() -> None:
    with pytest.raises(ValueError, match="large"):
        watcher(make_pool(), CollectorRegistry(), pools=["large"])
    with pytest.raises(ValueError, match="large"):
        watcher(make_pool(), CollectorRegistry(), fingerprints={"large": FP})
    assert watcher(make_pool(), CollectorRegistry(), ttl_s=6, poll_s=1).staleness_bound_s == 7


def test_records_are_untrusted_input() -> None:
    good = record("http://a:1")
    raw = encode_record(good)
    assert decode_record(raw, "small", "a:1") == good
    assert decode_record(raw, "large", "a:1") is None  # under another pool's key
    assert decode_record(raw, "small", "b:1") is None  # under another member's id
    assert decode_record(b"{nope", "small", "a:1") is None
    big = msgspec.structs.replace(good, devices=["cpu:0"] * MAX_RECORD_BYTES)
    assert decode_record(encode_record(big), "small", "a:1") is None
    unreachable = msgspec.structs.replace(good, url="http://0.0.0.0:1", member_id="0.0.0.0:1")
    assert decode_record(encode_record(unreachable), "small", "0.0.0.0:1") is None


@pytest.mark.parametrize(
    "url, why",
    [
        ("http://0.0.0.0:8000", "not an address others can reach"),
        ("http://10.0.0.2", "needs a port"),
        ("ftp://10.0.0.2:21", "http"),
        ("http://10.0.0.2:8000/v1", "no path"),
    ],
)
def test_an_advertise_url_must_be_reachable(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_url(url)


def test_names_states_and_urls() -> None:
    assert check_url("http://10.0.0.2:8000/") == "http://10.0.0.2:8000"
    assert check_name("small-2.b") == "small-2.b"
    with pytest.raises(ValueError):
        check_name("a b")
    assert [member_state(s) for s in ("loading", "ready", "stalled", "draining")] == [
        "starting",
        "ready",
        "ready",
        "draining",
    ]
