"""Quota arithmetic as pure functions over plain data: windows, Retry-After, which limit refused,
the x-ratelimit state, and what to do when Redis is unreachable. No Redis here.

Windows are fixed: minute index = floor(unix_s / 60), day index = floor(unix_s / 86400) (UTC
days), both from the Redis server clock. Times in seconds unless a name says otherwise.
"""

from dataclasses import dataclass

from quota.budget import Budget, resets_at_s
from quota.errors import BudgetExceeded, QuotaExceeded
from quota.models import TenantLimits

MINUTE_S = 60
DAY_S = 86_400
MINUTE_TTL_S = 2 * MINUTE_S  # a window lives on one window past its end, for late reconciles
DAY_TTL_S = 2 * DAY_S
PENDING_TTL_S = DAY_S  # how long after reserve a reconcile still counts
CONCURRENCY_RETRY_AFTER_S = 1.0
UNAVAILABLE_RETRY_AFTER_S = 1.0

# Bits of the reserve script's fail mask, in the order a refusal is reported: the limit that
# frees last first, so a client that waits Retry-After is not refused again by another limit.
FAIL_BITS = {
    "budget": 16,
    "tokens_per_day": 2,
    "tokens_per_minute": 1,
    "requests_per_minute": 4,
    "concurrency": 8,
}
LIMIT_CLASSES = ("tokens", "requests", "concurrency", "budget")
STATUS_ADMITTED, STATUS_REFUSED, STATUS_STALE_WINDOWS = 1, 0, -1


@dataclass(frozen=True)
class FailurePolicy:
    """Per limit class, what reserve does when Redis is unreachable: "open" admits the request
    unchecked, "closed" refuses it with QuotaUnavailable."""

    tokens: str = "open"  # tokens_per_minute and tokens_per_day
    requests: str = "open"  # requests_per_minute
    concurrency: str = "open"  # max_concurrent
    budget: str = "open"  # a hard money budget (`quota.budget`)

    def __post_init__(self) -> None:
        for name in LIMIT_CLASSES:
            if getattr(self, name) not in ("open", "closed"):
                raise ValueError(f"FailurePolicy.{name} must be 'open' or 'closed'")


@dataclass
class RateLimitState:
    """What the x-ratelimit-* headers report, per minute window; None fields = unlimited."""

    limit_tokens: int | None  # tokens_per_minute
    remaining_tokens: int | None  # after this request's reservation
    reset_tokens_s: float | None  # seconds until the minute window ends
    limit_requests: int | None  # requests_per_minute
    remaining_requests: int | None
    reset_requests_s: float | None


@dataclass(frozen=True)
class Windows:
    minute: int  # floor(unix_s / 60)
    day: int  # floor(unix_s / 86400)


@dataclass(frozen=True)
class ReserveReply:
    """The reserve script's reply. Counts are after the charge when admitted, else before."""

    status: int  # STATUS_ADMITTED, STATUS_REFUSED or STATUS_STALE_WINDOWS
    server_now_s: float
    tokens_minute: int = 0
    tokens_day: int = 0
    requests_minute: int = 0
    num_concurrent: int = 0
    fail_mask: int = 0
    windows: Windows | None = None  # the windows charged when admitted (None: stale windows)
    spent_nanos: int = 0  # money spent in the budget's period, after the charge if admitted
    soft_crossed: bool = False  # this reservation crossed the soft budget, first in its period


def windows_at(now_s: float) -> Windows:
    return Windows(minute=int(now_s // MINUTE_S), day=int(now_s // DAY_S))


def seconds_to_window_end(now_s: float, window_s: int) -> float:
    """Seconds until the fixed window containing `now_s` ends: in (0, window_s]."""
    return window_s - (now_s % window_s)


def limit_arg(limit: int | None) -> str:
    """A limit as a script argument: "" stands for None (unlimited)."""
    return "" if limit is None else str(int(limit))


def parse_reserve_reply(reply: list[int]) -> ReserveReply:
    status, sec, usec, *rest = (int(x) for x in reply)
    windows = Windows(rest[5], rest[6]) if len(rest) >= 7 else None
    counts = (rest + [0] * 5)[:5]
    spent, crossed = (rest[7], rest[8]) if len(rest) >= 9 else (0, 0)
    return ReserveReply(
        status,
        sec + usec / 1e6,
        tokens_minute=counts[0],
        tokens_day=counts[1],
        requests_minute=counts[2],
        num_concurrent=counts[3],
        fail_mask=counts[4],
        windows=windows,
        spent_nanos=spent,
        soft_crossed=bool(crossed),
    )


def refused_kinds(fail_mask: int) -> list[str]:
    """The limits a refusal broke, most binding (latest to free) first."""
    return [kind for kind, bit in FAIL_BITS.items() if fail_mask & bit]


def retry_after_s(kind: str, now_s: float) -> float:
    """Seconds from `now_s` (server clock) until `kind` frees capacity."""
    if kind == "tokens_per_day":
        return seconds_to_window_end(now_s, DAY_S)
    if kind in ("tokens_per_minute", "requests_per_minute"):
        return seconds_to_window_end(now_s, MINUTE_S)
    return CONCURRENCY_RETRY_AFTER_S


def exceeded_error(
    limits: TenantLimits, reply: ReserveReply, budget: Budget | None = None, holder: str = "tenant"
) -> QuotaExceeded:
    """The error for a refused reservation: the most binding limit it broke."""
    kind = refused_kinds(reply.fail_mask)[0]
    if kind == "budget":
        assert budget is not None and budget.hard_nanos is not None
        resets = resets_at_s(reply.server_now_s, budget)
        return BudgetExceeded(
            max(1.0, resets - reply.server_now_s),
            budget.hard_nanos,
            reply.spent_nanos,
            budget.period,
            resets,
            holder,
        )
    limit, used = {
        "tokens_per_day": (limits.tokens_per_day, reply.tokens_day),
        "tokens_per_minute": (limits.tokens_per_minute, reply.tokens_minute),
        "requests_per_minute": (limits.requests_per_minute, reply.requests_minute),
        "concurrency": (limits.max_concurrent, reply.num_concurrent),
    }[kind]
    assert limit is not None, f"the script refused on {kind}, which has no limit"
    code = "insufficient_quota" if kind == "tokens_per_day" else "rate_limit_exceeded"
    return QuotaExceeded(
        kind, code, retry_after_s(kind, reply.server_now_s), limit, max(0, limit - used)
    )


def rate_limit_state(limits: TenantLimits, reply: ReserveReply) -> RateLimitState:
    """x-ratelimit state after an admitted reservation (minute windows)."""
    reset_s = seconds_to_window_end(reply.server_now_s, MINUTE_S)
    tpm, rpm = limits.tokens_per_minute, limits.requests_per_minute
    return RateLimitState(
        limit_tokens=tpm,
        remaining_tokens=None if tpm is None else max(0, tpm - reply.tokens_minute),
        reset_tokens_s=None if tpm is None else reset_s,
        limit_requests=rpm,
        remaining_requests=None if rpm is None else max(0, rpm - reply.requests_minute),
        reset_requests_s=None if rpm is None else reset_s,
    )


def unlimited_state() -> RateLimitState:
    return RateLimitState(None, None, None, None, None, None)


def unavailable_decisions(
    limits: TenantLimits, policy: FailurePolicy, budget: Budget | None = None
) -> dict[str, str]:
    """Per limit class, "open" or "closed" while Redis is unreachable. Token and request counts
    are always kept (for usage), concurrency only under a max_concurrent; a class without a
    limit for this tenant has nothing to enforce and is open whatever the policy."""
    limited = {
        "tokens": limits.tokens_per_minute is not None or limits.tokens_per_day is not None,
        "requests": limits.requests_per_minute is not None,
        "concurrency": limits.max_concurrent is not None,
        "budget": budget is not None and budget.hard_nanos is not None,
    }
    return {
        cls: getattr(policy, cls) if limited[cls] else "open"
        for cls in LIMIT_CLASSES
        if cls not in ("concurrency", "budget") or limited[cls]
    }


def fits_context(limits: TenantLimits, num_tokens: int) -> bool:
    """Whether a request of `num_tokens` (prompt + max_tokens) fits the tenant's max_context."""
    return limits.max_context is None or num_tokens <= limits.max_context
