"""Usage aggregation and bucket choice: pure functions over the hashes reconcile.lua writes."""

import pytest

from quota.usage import DAY_S, HOUR_S, UsageConfig, aggregate, choose_range

CONFIG = UsageConfig(hour_retention_s=2 * DAY_S)
NOW = 1_000 * DAY_S + 5 * HOUR_S


def test_recent_ranges_use_hours_and_older_ones_days():
    assert choose_range(NOW - HOUR_S, NOW, "model", NOW, CONFIG).granularity == "hour"
    assert choose_range(NOW - 5 * DAY_S, NOW, "model", NOW, CONFIG).granularity == "day"
    assert choose_range(NOW - 5 * DAY_S, NOW, "hour", NOW, CONFIG).granularity == "hour"
    assert choose_range(NOW - HOUR_S, NOW, "day", NOW, CONFIG).granularity == "day"
    with pytest.raises(ValueError):
        choose_range(NOW, NOW, "model", NOW, CONFIG)


def test_range_is_widened_to_whole_buckets():
    rng = choose_range(NOW - 90 * 60, NOW - 60, "hour", NOW, CONFIG)
    assert rng.start_s % HOUR_S == 0 and rng.end_s % HOUR_S == 0
    assert rng.start_s <= NOW - 90 * 60 and rng.end_s >= NOW - 60
    assert len(rng.buckets()) == 2


def test_aggregate_groups_hours_into_days_models_and_keys():
    rng = choose_range(NOW - 30 * HOUR_S, NOW, "day", NOW, UsageConfig())
    rng_h = choose_range(NOW - 30 * HOUR_S, NOW, "hour", NOW, UsageConfig())
    h0 = rng_h.first
    hashes = [
        (h0, {b"small|k1|n": b"2", b"small|k1|prompt": b"10", b"small|k1|lat_ms": b"300"}),
        (h0 + 29, {b"large|k2|n": b"1", b"large|k2|completion": b"7", b"large|k2|err": b"1"}),
    ]
    by_model = {r["model"]: r for r in aggregate("t", hashes, rng_h, "model")}
    assert by_model["small"]["requests"] == 2 and by_model["small"]["mean_latency_ms"] == 150
    assert by_model["large"]["errors"] == 1 and by_model["large"]["total_tokens"] == 7
    by_key = aggregate("t", hashes, rng_h, "key")
    assert [r["key"] for r in by_key] == ["k1", "k2"]
    by_day = aggregate("t", hashes, rng_h, "day")
    assert [r["day"] % DAY_S for r in by_day] == [0, 0] and by_day[0]["day"] < by_day[1]["day"]
    assert rng.granularity == "day"
