"""The grammar cache's bounds and the build lane's turns, on plain values (no llguidance)."""

import threading

from workers.engine.config import GrammarCacheConfig
from workers.engine.grammar_cache import BuildLane, GrammarCache

MB = 2**20


def make_cache(max_bytes: int = 100 * MB, max_tenant_bytes: int = 40 * MB, max_entries: int = 256):
    return GrammarCache(
        GrammarCacheConfig(
            max_bytes=max_bytes, max_tenant_bytes=max_tenant_bytes, max_entries=max_entries
        )
    )


def fill(cache: GrammarCache, tenant: str, num: int, num_bytes: int, prefix: str = "s") -> None:
    for i in range(num):
        cache.put((tenant, f"{prefix}{i}"), f"{tenant}/{prefix}{i}", num_bytes)


def test_a_tenant_over_its_budget_gives_up_its_own_oldest_entries():
    cache = make_cache(max_tenant_bytes=40 * MB)
    fill(cache, "a", 10, 10 * MB)
    assert cache.tenant_bytes() == {"a": 40 * MB}
    assert [cache.get(("a", f"s{i}")) is not None for i in range(10)] == [False] * 6 + [True] * 4
    assert cache.num_evictions == 6


def test_a_flooding_tenant_displaces_only_itself():
    cache = make_cache(max_bytes=100 * MB, max_tenant_bytes=40 * MB)
    fill(cache, "victim", 3, 10 * MB)
    fill(cache, "other", 2, 15 * MB)
    fill(cache, "flood", 500, 3 * MB)
    assert all(cache.get(("victim", f"s{i}")) is not None for i in range(3))
    assert all(cache.get(("other", f"s{i}")) is not None for i in range(2))
    assert cache.tenant_bytes()["flood"] <= 40 * MB
    assert cache.num_bytes <= 100 * MB


def test_past_the_total_the_tenant_holding_most_gives_up_first():
    cache = make_cache(max_bytes=100 * MB, max_tenant_bytes=40 * MB)
    fill(cache, "big", 4, 10 * MB)  # 40 MB
    fill(cache, "mid", 3, 10 * MB)  # 30 MB
    fill(cache, "small", 2, 10 * MB)  # 20 MB: 90 MB in all
    cache.put(("small", "new"), "x", 20 * MB)  # 110 MB: "big" gives up its oldest
    assert cache.get(("big", "s0")) is None and cache.get(("big", "s1")) is not None
    assert cache.get(("mid", "s0")) is not None and cache.get(("small", "s0")) is not None
    assert cache.num_bytes == 100 * MB
    assert cache.tenant_bytes() == {"big": 30 * MB, "mid": 30 * MB, "small": 40 * MB}


def test_an_entry_larger_than_a_tenants_budget_is_not_kept():
    cache = make_cache(max_tenant_bytes=40 * MB)
    fill(cache, "a", 2, 10 * MB)
    assert not cache.put(("a", "huge"), "x", 41 * MB)
    assert cache.get(("a", "huge")) is None
    assert cache.num_bytes == 20 * MB and cache.num_evictions == 0


def test_past_the_entry_bound_the_tenant_with_most_entries_gives_one_up():
    cache = make_cache(max_entries=6)
    fill(cache, "a", 2, 1)
    fill(cache, "b", 4, 1)
    assert cache.put(("a", "new"), "x", 1)
    assert cache.num_entries == 6
    assert cache.get(("b", "s0")) is None and cache.get(("a", "s0")) is not None


def test_a_hit_makes_the_entry_its_tenants_most_recently_used():
    cache = make_cache(max_tenant_bytes=30 * MB)
    fill(cache, "a", 3, 10 * MB)
    assert cache.get(("a", "s0")) == "a/s0"
    cache.put(("a", "new"), "x", 10 * MB)
    assert cache.get(("a", "s0")) is not None and cache.get(("a", "s1")) is None


def test_tenants_never_share_an_entry():
    cache = make_cache()
    cache.put(("a", "schema"), "a's", 1 * MB)
    assert cache.get(("b", "schema")) is None
    cache.put(("b", "schema"), "b's", 1 * MB)
    assert cache.get(("a", "schema")) == "a's" and cache.get(("b", "schema")) == "b's"
    assert cache.tenant_bytes() == {"a": 1 * MB, "b": 1 * MB}


def test_a_tenant_whose_last_entry_goes_is_forgotten():
    cache = make_cache(max_bytes=20 * MB, max_tenant_bytes=20 * MB)
    cache.put(("a", "s"), "x", 12 * MB)
    fill(cache, "b", 2, 5 * MB)  # 22 MB in all: "a", holding the most, gives up its only one
    assert cache.tenant_bytes() == {"b": 10 * MB}
    assert cache.num_entries == 2


def _wait_for_waiting(lane: BuildLane, num: int) -> None:
    with lane._cond:
        assert lane._cond.wait_for(lambda: lane.num_waiting == num, timeout=10)


def test_tenants_waiting_for_the_build_lane_take_turns():
    lane = BuildLane()
    order: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def build(name: str, tenant: str) -> None:
        with lane.turn(tenant):
            order.append(name)
            if name == "a1":
                holding.set()
                assert release.wait(10)

    threads = [threading.Thread(target=build, args=("a1", "a"))]
    threads[0].start()
    assert holding.wait(10)
    for num, (name, tenant) in enumerate([("a2", "a"), ("a3", "a"), ("b1", "b")], 1):
        threads.append(threading.Thread(target=build, args=(name, tenant)))
        threads[-1].start()
        _wait_for_waiting(lane, num)
    release.set()
    for t in threads:
        t.join(10)
    # b's first build comes before a's third, though a asked for it first.
    assert order == ["a1", "a2", "b1", "a3"]
    assert lane.num_waiting == 0


def test_a_free_lane_is_taken_at_once_and_freed_after():
    lane = BuildLane()
    with lane.turn("a"):
        pass
    with lane.turn("b"):
        assert lane.num_waiting == 0
