"""Several gateway processes on one port: the capacity split, the restart backoff and the
merged metrics view (the supervisor and the processes: tests/integration/gateway/)."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig
from gateway.runtime.group import RestartPolicy, member_configs, restart_delay_s, split_evenly
from gateway.runtime.group_metrics import merge_expositions, render


@pytest.mark.parametrize(
    ("total", "num_parts", "shares"),
    [(32, 1, [32]), (32, 2, [16, 16]), (33, 2, [17, 16]), (7, 3, [3, 2, 2]), (3, 2, [2, 1])],
)
def test_split_evenly_spreads_the_remainder_over_the_first_parts(total, num_parts, shares):
    assert split_evenly(total, num_parts) == shares


def test_split_evenly_never_promises_more_than_the_total_unless_below_one_each():
    for total in range(1, 70):
        for n in range(1, 9):
            shares = split_evenly(total, n)
            assert len(shares) == n and min(shares) >= 1
            assert max(shares) - min(shares) <= 1
            assert sum(shares) == max(total, n)  # only a share below 1 is rounded up


def test_member_configs_split_the_worker_slots_and_queue_and_share_redis():
    config = GatewayConfig(
        pools={"small": ["http://w"]},
        processes=3,
        max_inflight_per_worker=8,
        queue_max_requests=100,
        queue_max_tokens=1000,
        header_timeout_s=3.0,
    )
    members = member_configs(config, "redis://r:6379/0")
    assert [m.max_inflight_per_worker for m in members] == [3, 3, 2]
    assert [m.queue_max_requests for m in members] == [34, 33, 33]
    assert [m.queue_max_tokens for m in members] == [334, 333, 333]
    assert {m.redis_url for m in members} == {"redis://r:6379/0"}
    assert all(m.header_timeout_s == 3.0 and m.pools == config.pools for m in members)
    assert config.max_inflight_per_worker == 8 and config.redis_url is None  # not changed


def test_restart_delay_doubles_per_crash_in_a_row_up_to_the_cap():
    policy = RestartPolicy(base_s=1.0, max_s=10.0)
    assert [restart_delay_s(n, policy) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]


def _exposition(requests: float) -> str:
    registry = CollectorRegistry()
    counter = Counter("demo_requests", "Requests.", ["status"], registry=registry)
    counter.labels("200").inc(requests)
    Gauge("demo_depth", "Queue depth.", registry=registry).set(requests * 2)
    Histogram("demo_latency_seconds", "Latency.", buckets=[1.0], registry=registry).observe(0.5)
    return generate_latest(registry).decode()


def test_merged_metrics_label_every_sample_with_its_process_and_keep_one_head_per_family():
    text = render(merge_expositions({"0": _exposition(3), "1": _exposition(5)})).decode()
    assert text.count("# TYPE demo_requests_total counter") == 1
    assert text.count("# HELP demo_depth Queue depth.") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = {s.labels["process"]: s.value for s in families["demo_requests"].samples}
    assert requests == {"0": 3.0, "1": 5.0}
    depth = {s.labels["process"]: s.value for s in families["demo_depth"].samples}
    assert depth == {"0": 6.0, "1": 10.0}
    buckets = [s for s in families["demo_latency_seconds"].samples if s.name.endswith("_bucket")]
    assert {(s.labels["process"], s.labels["le"]) for s in buckets} == {
        ("0", "1.0"),
        ("0", "+Inf"),
        ("1", "1.0"),
        ("1", "+Inf"),
    }
    assert all(s.labels["status"] == "200" for s in families["demo_requests"].samples)
