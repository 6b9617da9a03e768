"""A busy engine is stalled only when its thread makes no progress: an old heartbeat with
the thread's CPU clock advancing is a slow step, not a stall."""

import pytest

from workers.server.stall import StallWatch


def test_a_fresh_heartbeat_is_ok_whatever_the_cpu():
    watch = StallWatch(timeout_s=5.0, hard_timeout_s=60.0)
    assert watch.observe(104.0, (100.0, 1.0), cpu_s=1.0) == "ok"
    assert watch.observe(104.0, (100.0, 1.0), cpu_s=None) == "ok"


def test_an_old_heartbeat_with_the_thread_computing_is_slow_not_stalled():
    watch = StallWatch(timeout_s=5.0, hard_timeout_s=60.0)
    cpu = 1.0
    for now in range(101, 140):  # a 40 s step on shared cores: 20 % of a core
        cpu += 0.2
        expected = "ok" if now <= 105 else "slow"
        assert watch.observe(float(now), (100.0, 1.0), cpu_s=cpu) == expected


def test_a_blocked_thread_is_stalled_once_its_cpu_clock_stood_still_for_the_timeout():
    watch = StallWatch(timeout_s=5.0, hard_timeout_s=60.0)
    # It computed until 103, then blocked: CPU stays at 1.6 from then on.
    reads = [(101.0, 1.2), (102.0, 1.4), (103.0, 1.6), (104.0, 1.6), (105.0, 1.6)]
    for now, cpu in reads:
        assert watch.observe(now, (100.0, 1.0), cpu) == "ok"
    # At 106 and 107 the read 5 s before is from before the block: CPU moved since, slow.
    assert watch.observe(106.0, (100.0, 1.0), 1.6) == "slow"
    assert watch.observe(107.0, (100.0, 1.0), 1.6) == "slow"
    # From 108 the window starts at the block (103): nothing moved in it, stalled.
    assert watch.observe(108.0, (100.0, 1.0), 1.6) == "stalled"
    assert watch.observe(110.0, (100.0, 1.0), 1.6) == "stalled"


def test_without_reads_of_its_own_the_window_starts_at_the_heartbeat():
    watch = StallWatch(timeout_s=5.0, hard_timeout_s=60.0)
    assert watch.observe(107.0, (100.0, 1.0), cpu_s=1.0) == "stalled"  # blocked since
    assert StallWatch(5.0, 60.0).observe(107.0, (100.0, 1.0), cpu_s=1.5) == "slow"


def test_a_step_past_the_hard_timeout_is_stalled_even_while_it_uses_cpu():
    watch = StallWatch(timeout_s=5.0, hard_timeout_s=30.0)
    assert watch.observe(129.0, (100.0, 1.0), cpu_s=20.0) == "slow"
    assert watch.observe(131.0, (100.0, 1.0), cpu_s=21.0) == "stalled"


def test_no_cpu_clock_falls_back_to_the_heartbeat_alone():
    watch = StallWatch(timeout_s=5.0, hard_timeout_s=60.0)
    assert watch.observe(106.0, (100.0, 1.0), cpu_s=None) == "stalled"


def test_the_timeouts_must_be_ordered():
    with pytest.raises(ValueError):
        StallWatch(timeout_s=10.0, hard_timeout_s=5.0)
