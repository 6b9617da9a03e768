"""Quota arithmetic without Redis."""

import pytest

from quota.models import TenantLimits
from quota.policy import (
    CONCURRENCY_RETRY_AFTER_S,
    STATUS_REFUSED,
    FailurePolicy,
    ReserveReply,
    Windows,
    exceeded_error,
    fits_context,
    limit_arg,
    parse_reserve_reply,
    rate_limit_state,
    refused_kinds,
    retry_after_s,
    seconds_to_window_end,
    unavailable_decisions,
    windows_at,
)

DAY0 = 20_000 * 86_400.0  # a UTC midnight


def test_windows_are_fixed_minutes_and_utc_days() -> None:
    w = windows_at(DAY0 + 61.5)
    assert (w.minute, w.day) == (int(DAY0 // 60) + 1, 20_000)
    assert windows_at(DAY0 - 0.001).day == 19_999
    assert windows_at(DAY0 + 59.999).minute == windows_at(DAY0).minute


@pytest.mark.parametrize(
    ("now_s", "window_s", "expected"),
    [(DAY0, 60, 60.0), (DAY0 + 59.5, 60, 0.5), (DAY0 + 30, 86_400, 86_370.0)],
)
def test_seconds_to_window_end_is_in_zero_exclusive_to_window(
    now_s: float, window_s: int, expected: float
) -> None:
    assert seconds_to_window_end(now_s, window_s) == pytest.approx(expected)


def test_limit_arg_encodes_none_as_empty() -> None:
    assert (limit_arg(None), limit_arg(5)) == ("", "5")


def test_parse_reserve_reply_reads_server_time_and_counts() -> None:
    reply = parse_reserve_reply([0, 1_700_000_000, 250_000, 10, 20, 3, 1, 9])
    assert reply.server_now_s == pytest.approx(1_700_000_000.25)
    assert (reply.tokens_minute, reply.tokens_day, reply.requests_minute) == (10, 20, 3)
    assert (reply.num_concurrent, reply.fail_mask) == (1, 9)
    assert parse_reserve_reply([-1, 5, 0]).status == -1


def test_refused_kinds_put_the_latest_to_free_first() -> None:
    assert refused_kinds(1 | 2 | 4 | 8) == [
        "tokens_per_day",
        "tokens_per_minute",
        "requests_per_minute",
        "concurrency",
    ]
    assert refused_kinds(8 | 4) == ["requests_per_minute", "concurrency"]


def test_retry_after_counts_to_the_end_of_the_refusing_window() -> None:
    now = DAY0 + 3600 + 45.0
    assert retry_after_s("tokens_per_minute", now) == pytest.approx(15.0)
    assert retry_after_s("requests_per_minute", now) == pytest.approx(15.0)
    assert retry_after_s("tokens_per_day", now) == pytest.approx(86_400 - 3645.0)
    assert retry_after_s("concurrency", now) == CONCURRENCY_RETRY_AFTER_S


def test_exceeded_error_for_the_day_is_insufficient_quota() -> None:
    limits = TenantLimits(tokens_per_minute=100, tokens_per_day=1000)
    reply = ReserveReply(STATUS_REFUSED, DAY0 + 10, tokens_minute=95, tokens_day=990, fail_mask=3)
    err = exceeded_error(limits, reply)
    assert (err.kind, err.code, err.limit, err.remaining) == (
        "tokens_per_day",
        "insufficient_quota",
        1000,
        10,
    )
    assert err.retry_after_s == pytest.approx(86_390.0)


def test_exceeded_error_for_the_minute_is_retryable_and_remaining_never_negative() -> None:
    limits = TenantLimits(tokens_per_minute=100)
    reply = ReserveReply(STATUS_REFUSED, DAY0 + 10, tokens_minute=120, fail_mask=1)
    err = exceeded_error(limits, reply)
    assert (err.kind, err.code, err.remaining) == ("tokens_per_minute", "rate_limit_exceeded", 0)
    assert err.retry_after_s == pytest.approx(50.0)


def test_rate_limit_state_reports_minute_windows_and_none_when_unlimited() -> None:
    reply = ReserveReply(1, DAY0 + 20, tokens_minute=300, requests_minute=4)
    state = rate_limit_state(TenantLimits(tokens_per_minute=1000), reply)
    assert (state.limit_tokens, state.remaining_tokens) == (1000, 700)
    assert state.reset_tokens_s == pytest.approx(40.0)
    assert (state.limit_requests, state.remaining_requests, state.reset_requests_s) == (
        None,
        None,
        None,
    )


def test_unavailable_decisions_apply_the_policy_only_to_limited_classes() -> None:
    closed = FailurePolicy(tokens="closed", requests="closed", concurrency="closed")
    assert unavailable_decisions(TenantLimits(), closed) == {"tokens": "open", "requests": "open"}
    limits = TenantLimits(tokens_per_day=5, max_concurrent=2)
    assert unavailable_decisions(limits, closed) == {
        "tokens": "closed",
        "requests": "open",
        "concurrency": "closed",
    }
    assert set(unavailable_decisions(limits, FailurePolicy()).values()) == {"open"}


def test_failure_policy_rejects_unknown_decisions() -> None:
    with pytest.raises(ValueError):
        FailurePolicy(tokens="maybe")


def test_fits_context() -> None:
    assert fits_context(TenantLimits(), 10**9)
    assert fits_context(TenantLimits(max_context=100), 100)
    assert not fits_context(TenantLimits(max_context=100), 101)


def test_parse_reserve_reply_reads_the_windows_charged() -> None:
    reply = parse_reserve_reply([1, 1_700_000_000, 0, 10, 20, 3, 1, 0, 28_333_333, 19_675])
    assert reply.windows == Windows(28_333_333, 19_675)
    assert parse_reserve_reply([-1, 5, 0]).windows is None
