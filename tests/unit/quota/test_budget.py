"""Budgets as plain data: what an admin may set, the calendar of periods, the state shown."""

import datetime as dt

import pytest

from quota.budget import (
    NANOS,
    Budget,
    budget_from_dict,
    budget_state,
    budget_to_dict,
    month_of_day,
    resets_at_s,
    spend_windows,
)
from quota.errors import InvalidLimits


def ts(*args: int) -> float:
    return dt.datetime(*args, tzinfo=dt.UTC).timestamp()


def test_a_budget_round_trips_in_units_of_currency_and_is_kept_in_nanos() -> None:
    b = budget_from_dict({"period": "day", "hard": 12.5, "soft": 10, "spend_target": 8})
    assert b == Budget("day", None, 12_500_000_000, 10 * NANOS, 8 * NANOS)
    assert budget_to_dict(b) == {
        "period": "day",
        "window_days": None,
        "hard": 12.5,
        "soft": 10.0,
        "spend_target": 8.0,
    }
    assert budget_from_dict(None) is None


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"period": "week", "hard": 1}, "budget.period"),
        ({"period": "rolling", "hard": 1}, "budget.window_days"),
        ({"period": "rolling", "window_days": 0, "hard": 1}, "budget.window_days"),
        ({"period": "rolling", "window_days": 91, "hard": 1}, "budget.window_days"),
        ({"period": "day", "window_days": 3, "hard": 1}, "budget.window_days"),
        ({"hard": -1}, "budget.hard"),
        ({"hard": float("nan")}, "budget.hard"),
        ({"soft": True}, "budget.soft"),
        ({"hard": "10"}, "budget.hard"),
        ({"hard": 1e12}, "budget.hard"),
        ({"period": "month"}, "budget"),
        ({"hard": 1, "currency": "EUR"}, "budget"),
        ([1], "budget"),
    ],
)
def test_a_bad_budget_is_refused_naming_the_field(raw: object, param: str) -> None:
    with pytest.raises(InvalidLimits) as err:
        budget_from_dict(raw)
    assert err.value.param == param


def test_months_and_resets_follow_the_utc_calendar() -> None:
    day = int(ts(2026, 12, 31, 23) // 86400)
    assert month_of_day(day) == 2026 * 12 + 11
    assert month_of_day(day + 1) == 2027 * 12 + 0
    assert resets_at_s(ts(2026, 12, 31, 23), Budget("month")) == ts(2027, 1, 1)
    assert resets_at_s(ts(2026, 2, 10, 5), Budget("month")) == ts(2026, 3, 1)
    assert resets_at_s(ts(2026, 2, 10, 5), Budget("day")) == ts(2026, 2, 11)
    assert resets_at_s(ts(2026, 2, 10, 5), Budget("rolling", 7)) == ts(2026, 2, 11)
    assert spend_windows(day, Budget("rolling", 3)).earlier_days == (day - 1, day - 2)
    assert spend_windows(day, Budget("month")).earlier_days == ()


def test_the_state_says_spent_remaining_and_reset_in_units() -> None:
    b = Budget("day", hard_nanos=2 * NANOS, soft_nanos=NANOS)
    state = budget_state(b, 3 * NANOS // 2, ts(2026, 5, 5, 12))
    assert state["spent"] == 1.5 and state["remaining"] == 0.5
    assert state["resets_at"] == ts(2026, 5, 6)
    assert budget_state(b, 5 * NANOS, ts(2026, 5, 5))["remaining"] == 0
