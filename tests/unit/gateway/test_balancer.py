"""Worker choice: least loaded, eligibility, and rendezvous prefix affinity."""

from gateway.capacity.balancer import (
    WorkerView,
    choose_worker,
    has_room,
    load_score,
    prefix_key,
)


def make_worker(url: str, **overrides: object) -> WorkerView:
    fields: dict[str, object] = dict(
        url=url,
        state="ready",
        num_running=0,
        num_waiting=0,
        kv_free_tokens=1000,
        kv_total_tokens=1000,
        inflight=0,
        max_inflight=4,
    )
    fields.update(overrides)
    return WorkerView(**fields)  # type: ignore[arg-type]


def make_pool(n: int) -> list[WorkerView]:
    return [make_worker(f"http://w{i}:8000") for i in range(n)]


KEYS = [prefix_key(f"system prompt number {i}") for i in range(200)]


def test_prefix_key_is_stable_and_reads_only_the_prefix() -> None:
    # Pinned values: the key must not change across processes or releases.
    assert prefix_key("You are a helpful assistant.").hex() == "df5f947c7a4708f5eb0909c3362509eb"
    assert prefix_key([1, 2, 3]).hex() == "586b0f5ea11ccb576df2d80c425ef2dd"
    assert prefix_key("x" * 512 + "tail one") == prefix_key("x" * 512 + "tail two")
    assert prefix_key("x" * 511 + "a") != prefix_key("x" * 511 + "b")
    assert prefix_key([1, 2, 3, 4], num_chars=3) == prefix_key([1, 2, 3])
    assert prefix_key("1,2,3") != prefix_key([1, 2, 3])


def test_has_room_needs_ready_and_inflight_under_cap() -> None:
    assert has_room(make_worker("a", inflight=3, max_inflight=4))
    assert not has_room(make_worker("a", inflight=4, max_inflight=4))
    for state in ("loading", "draining", "stalled", "unreachable"):
        assert not has_room(make_worker("a", state=state))


def test_load_score_counts_inflight_waiting_running_and_kv_pressure() -> None:
    idle = load_score(make_worker("a"))
    assert idle == 0.0
    assert load_score(make_worker("a", inflight=1)) > idle
    assert load_score(make_worker("a", num_waiting=1)) > load_score(make_worker("a", num_running=1))
    assert load_score(make_worker("a", num_running=1)) > idle
    assert load_score(make_worker("a", kv_free_tokens=0)) > load_score(
        make_worker("a", kv_free_tokens=500)
    )
    # Unknown KV size (an external server) is no pressure, not a division by zero.
    assert load_score(make_worker("a", kv_free_tokens=0, kv_total_tokens=0)) == idle


def test_chooses_least_loaded_without_affinity() -> None:
    workers = [
        make_worker("a", inflight=2),
        make_worker("b", num_waiting=3),
        make_worker("c", inflight=1),
        make_worker("d", inflight=1, kv_free_tokens=0),
    ]
    assert choose_worker(workers, None).url == "c"


def test_skips_not_ready_full_and_excluded_workers() -> None:
    workers = [
        make_worker("loading", state="loading"),
        make_worker("draining", state="draining"),
        make_worker("stalled", state="stalled"),
        make_worker("gone", state="unreachable"),
        make_worker("full", inflight=4, max_inflight=4),
        make_worker("failed-before"),
        make_worker("busy-but-ok", inflight=3, num_waiting=10),
    ]
    assert choose_worker(workers, None, exclude={"failed-before"}).url == "busy-but-ok"
    for key in KEYS[:20]:
        assert choose_worker(workers, key, exclude={"failed-before"}).url == "busy-but-ok"
    assert choose_worker(workers, None, exclude={"failed-before", "busy-but-ok"}) is None
    assert choose_worker([], None) is None


def test_affinity_sticks_to_one_worker_per_key_and_spreads_keys() -> None:
    workers = make_pool(8)
    chosen = {key: choose_worker(workers, key).url for key in KEYS}
    for key in KEYS:
        assert choose_worker(workers, key).url == chosen[key]
        assert choose_worker(list(reversed(workers)), key).url == chosen[key]
    # Idle workers all tie on load, so this spread comes from the hash, not the load.
    assert len(set(chosen.values())) == 8


def test_affinity_survives_an_unrelated_member_joining_or_leaving() -> None:
    workers = make_pool(5)
    before = {key: choose_worker(workers, key).url for key in KEYS}

    joined = [*workers, make_worker("http://new:8000")]
    after_join = {key: choose_worker(joined, key).url for key in KEYS}
    moved = [key for key in KEYS if after_join[key] != before[key]]
    assert all(after_join[key] == "http://new:8000" for key in moved)
    assert 10 <= len(moved) <= 70  # about 1/6 of 200 keys, not a reshuffle

    leaving = workers[2].url
    left = [w for w in workers if w.url != leaving]
    after_leave = {key: choose_worker(left, key).url for key in KEYS}
    for key in KEYS:
        if before[key] != leaving:
            assert after_leave[key] == before[key]


def test_affinity_falls_to_the_next_rendezvous_choice_when_preferred_is_full() -> None:
    workers = make_pool(5)
    key = KEYS[0]
    preferred = choose_worker(workers, key).url
    without = choose_worker([w for w in workers if w.url != preferred], key).url
    full = [
        make_worker(w.url, inflight=w.max_inflight) if w.url == preferred else w for w in workers
    ]
    assert choose_worker(full, key).url == without
    assert choose_worker(workers, key, exclude={preferred}).url == without


def test_affinity_yields_to_least_loaded_only_beyond_busy_slack() -> None:
    workers = make_pool(4)
    key = KEYS[1]
    preferred = choose_worker(workers, key).url

    def with_preferred_inflight(n: int) -> list[WorkerView]:
        return [
            make_worker(w.url, inflight=n, max_inflight=10) if w.url == preferred else w
            for w in workers
        ]

    assert choose_worker(with_preferred_inflight(2), key, busy_slack=2.0).url == preferred
    fallback = choose_worker(with_preferred_inflight(3), key, busy_slack=2.0)
    assert fallback.url != preferred
    assert load_score(fallback) == 0.0
    assert choose_worker(with_preferred_inflight(3), key, busy_slack=5.0).url == preferred
