"""Money budgets as plain data and pure arithmetic: the period a budget counts over, the
spend counters it reads, when it resets, and the checks on what an admin sets. No Redis here.

Money is counted in integer *nanos* of the gateway's currency (1e-9 of a unit): a token of a
small model costs a fraction of a micro-dollar, and Lua counts exactly in doubles up to 2**53
nanos (about 9 million units), far past any one tenant's period.

Spend counters (tenant hash tag, see `quota.keyspace`), kept for every request whose pool has
a price, budget or not, so a budget set mid-period sees what was already spent:
    sy:{t}:spend:d:<day>     nanos charged on that UTC day (day = floor(unix_s / 86400))
    sy:{t}:spend:m:<month>   nanos charged in that UTC calendar month (year * 12 + month - 1)
A request is charged its worst case at reserve and corrected to its real cost at reconcile,
on the day and month it was reserved in.

Periods: "day" (the UTC day), "month" (the UTC calendar month) and "rolling" (the last
`window_days` UTC days, today included, summed from the day counters).
"""

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any

from quota.errors import InvalidLimits

NANOS = 1_000_000_000  # nanos in one unit of currency
DAY_S = 86_400
PERIODS = ("day", "month", "rolling")
MAX_WINDOW_DAYS = 90
MAX_AMOUNT = 2**53 // NANOS  # the most a budget may hold, in units of currency
# A rolling budget reads day counters up to MAX_WINDOW_DAYS back; a month counter lives on
# one month past its end (late reconciles).
SPEND_DAY_TTL_S = (MAX_WINDOW_DAYS + 2) * DAY_S
SPEND_MONTH_TTL_S = 63 * DAY_S


@dataclass(frozen=True)
class Budget:
    """A spending limit in money over a period, for a tenant or one API key.

    hard_nanos: requests that could take spend past it are refused (429), never charged.
    soft_nanos: crossing it fires the budget webhook and a metric, once per period.
    spend_target_nanos: as spend nears it, `model: auto` sends less to the expensive pool
      (`cascade.policy.budget_threshold`) before anything is refused.
    Each None: not set.
    """

    period: str = "month"  # day | month | rolling
    window_days: int | None = None  # rolling only: days counted, today included
    hard_nanos: int | None = None
    soft_nanos: int | None = None
    spend_target_nanos: int | None = None


@dataclass(frozen=True)
class SpendWindows:
    """The counters one reservation charges and reads: its day and month, and for a rolling
    budget the earlier days of its window (newest first)."""

    day: int
    month: int
    earlier_days: tuple[int, ...] = ()


def to_nanos(amount: float) -> int:
    return int(round(amount * NANOS))


def to_amount(nanos: int | None) -> float | None:
    return None if nanos is None else nanos / NANOS


def month_of_day(day: int) -> int:
    """The UTC calendar month of a day index, as year * 12 + (month - 1)."""
    d = dt.date(1970, 1, 1) + dt.timedelta(days=day)
    return d.year * 12 + d.month - 1


def spend_windows(day: int, budget: Budget | None) -> SpendWindows:
    earlier: tuple[int, ...] = ()
    if budget is not None and budget.period == "rolling" and budget.window_days:
        earlier = tuple(day - i for i in range(1, budget.window_days))
    return SpendWindows(day, month_of_day(day), earlier)


def resets_at_s(now_s: float, budget: Budget) -> float:
    """Unix seconds when the period's spend next drops: the next UTC midnight for a day or a
    rolling budget (its oldest day leaves the window then), the next month's first for a
    month budget."""
    next_midnight = (math.floor(now_s / DAY_S) + 1) * DAY_S
    if budget.period != "month":
        return float(next_midnight)
    today = dt.datetime.fromtimestamp(now_s, dt.UTC).date()
    first = dt.date(today.year + today.month // 12, today.month % 12 + 1, 1)
    return dt.datetime(first.year, first.month, first.day, tzinfo=dt.UTC).timestamp()


# -- what an admin sets --------------------------------------------------------------------


def _amount(raw: dict, name: str, where: str) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_AMOUNT
    ):
        raise InvalidLimits(
            f"{where}.{name} must be an amount of money above 0 and up to {MAX_AMOUNT}, "
            f"or null; got {value!r}",
            param=f"{where}.{name}",
        )
    return to_nanos(float(value))


def budget_from_dict(raw: Any, where: str = "budget") -> Budget | None:
    """A budget from its API form: {period, window_days, hard, soft, spend_target}, amounts
    in units of currency; None for null. Raises InvalidLimits naming the field."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidLimits(f"{where} must be an object or null", param=where)
    unknown = sorted(set(raw) - {"period", "window_days", "hard", "soft", "spend_target"})
    if unknown:
        raise InvalidLimits(f"{where}.{unknown[0]} is not a budget field", param=where)
    period = raw.get("period", "month")
    if period not in PERIODS:
        raise InvalidLimits(
            f"{where}.period must be one of {', '.join(PERIODS)}", param=f"{where}.period"
        )
    window = raw.get("window_days")
    if period == "rolling":
        if isinstance(window, bool) or not isinstance(window, int):
            raise InvalidLimits(
                f"{where}.window_days must be an integer (1 to {MAX_WINDOW_DAYS}) for a "
                "rolling budget",
                param=f"{where}.window_days",
            )
        if not 1 <= window <= MAX_WINDOW_DAYS:
            raise InvalidLimits(
                f"{where}.window_days must be between 1 and {MAX_WINDOW_DAYS}",
                param=f"{where}.window_days",
            )
    elif window is not None:
        raise InvalidLimits(
            f"{where}.window_days is for a rolling budget only", param=f"{where}.window_days"
        )
    budget = Budget(
        period=period,
        window_days=window,
        hard_nanos=_amount(raw, "hard", where),
        soft_nanos=_amount(raw, "soft", where),
        spend_target_nanos=_amount(raw, "spend_target", where),
    )
    if (
        budget.hard_nanos is None
        and budget.soft_nanos is None
        and budget.spend_target_nanos is None
    ):
        raise InvalidLimits(
            f"{where} sets none of hard, soft or spend_target: use null for no budget",
            param=where,
        )
    return budget


def budget_to_dict(budget: Budget | None) -> dict | None:
    if budget is None:
        return None
    return {
        "period": budget.period,
        "window_days": budget.window_days,
        "hard": to_amount(budget.hard_nanos),
        "soft": to_amount(budget.soft_nanos),
        "spend_target": to_amount(budget.spend_target_nanos),
    }


def budget_to_doc(budget: Budget | None) -> dict | None:
    """As stored in the tenant or key record (nanos, exact)."""
    if budget is None:
        return None
    return {
        "period": budget.period,
        "window_days": budget.window_days,
        "hard_nanos": budget.hard_nanos,
        "soft_nanos": budget.soft_nanos,
        "spend_target_nanos": budget.spend_target_nanos,
    }


def budget_from_doc(doc: dict | None) -> Budget | None:
    if not doc:
        return None
    return Budget(
        period=doc.get("period", "month"),
        window_days=doc.get("window_days"),
        hard_nanos=doc.get("hard_nanos"),
        soft_nanos=doc.get("soft_nanos"),
        spend_target_nanos=doc.get("spend_target_nanos"),
    )


def budget_state(budget: Budget, spent_nanos: int, now_s: float) -> dict:
    """What `GET /v1/usage` says of a budget: its settings, spent and remaining in the current
    period (units of currency), and when it resets."""
    doc = budget_to_dict(budget)
    assert doc is not None
    hard = budget.hard_nanos
    doc.update(
        spent=spent_nanos / NANOS,
        remaining=None if hard is None else max(0, hard - spent_nanos) / NANOS,
        resets_at=resets_at_s(now_s, budget),
    )
    return doc
