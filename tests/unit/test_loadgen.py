"""The load generator's arithmetic: Poisson arrivals, percentiles, the summary."""

import random

import pytest

from benchmarks.loadgen import Outcome, arrival_times, build_request, percentile, summarise


def test_poisson_arrivals_average_the_rate_within_the_duration() -> None:
    times = arrival_times(20.0, 100.0, random.Random(1))
    assert all(0 <= t < 100 for t in times) and times == sorted(times)
    assert 1800 < len(times) < 2200


def test_percentiles_and_summary_separate_served_refused_and_failed() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0
    ok = Outcome("short", 0, 0.0, 200, 0.1, [0.01, 0.03], 1.0, 3, pool="small", route="forced")
    refused = Outcome("short", 0, 0.5, 429, done_s=0.01, retry_after_s=2.0)
    cut = Outcome("long", 1, 0.7, 200, 0.2, [], 2.0, error="upstream_failed")
    s = summarise([ok, refused, cut], [ok, refused, cut], 2.0)
    assert (s["offered"], s["served"], s["refused"], s["failed"]) == (3, 1, 1, 1)
    assert s["retry_after_s_max"] == 2.0 and s["ttft_p50_s"] == 0.1
    assert s["itl_p99_s"] == 0.03 and s["routes"] == {"small/forced": 1}


def test_every_mix_builds_a_streaming_chat_request_and_an_unknown_one_is_refused() -> None:
    rng = random.Random(0)
    a = build_request("shared-prefix", rng, "auto")
    b = build_request("shared-prefix", rng, "auto")
    assert a["messages"][0] == b["messages"][0] and a["stream"] and a["model"] == "auto"
    assert len(build_request("long", rng, "small")["messages"][0]["content"]) > 1000
    with pytest.raises(ValueError, match="unknown workload"):
        build_request("huge", rng, "auto")
