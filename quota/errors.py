"""Errors of the quota package. Each carries data; none knows HTTP (the gateway maps them)."""

QUOTA_KINDS = (
    "tokens_per_minute",
    "tokens_per_day",
    "requests_per_minute",
    "concurrency",
    "budget",
)


class QuotaError(Exception):
    """Base class of every error raised by `quota`."""


class TenantNotFound(QuotaError):
    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"unknown tenant {tenant_id!r}")
        self.tenant_id = tenant_id


class TenantExists(QuotaError):
    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"tenant {tenant_id!r} already exists")
        self.tenant_id = tenant_id


class InvalidLimits(QuotaError):
    """Bad input to the store: `param` names the offending field (e.g. "limits.max_concurrent")."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class QuotaExceeded(QuotaError):
    """A reservation was refused; nothing was charged.

    kind: which limit refused it, one of QUOTA_KINDS.
    code: "insufficient_quota" for the day budget, else "rate_limit_exceeded".
    retry_after_s: seconds (from the Redis server clock) until that limit frees capacity.
    limit: the limit that refused (tokens or requests, per its window).
    remaining: what was left of it before this request (>= 0).
    """

    def __init__(
        self, kind: str, code: str, retry_after_s: float, limit: int, remaining: int
    ) -> None:
        super().__init__(
            f"{kind} exceeded (limit {limit}, remaining {remaining}); "
            f"retry after {retry_after_s:.1f}s"
        )
        self.kind = kind
        self.code = code
        self.retry_after_s = retry_after_s
        self.limit = limit
        self.remaining = remaining


class BudgetExceeded(QuotaExceeded):
    """A reservation would take spend past a hard money budget; nothing was charged.
    Amounts in nanos of the gateway's currency (`quota.budget`); `limit` and `remaining`
    are too. `resets_at_s`: unix seconds when the period's spend next drops. `holder`:
    "tenant" or "key" (whose budget refused)."""

    def __init__(
        self,
        retry_after_s: float,
        hard_nanos: int,
        spent_nanos: int,
        period: str,
        resets_at_s: float,
        holder: str = "tenant",
    ) -> None:
        super().__init__(
            "budget", "budget_exceeded", retry_after_s, hard_nanos, max(0, hard_nanos - spent_nanos)
        )
        self.spent_nanos = spent_nanos
        self.period = period
        self.resets_at_s = resets_at_s
        self.holder = holder


class QuotaUnavailable(QuotaError):
    """Redis is unreachable and the limit class fails closed (or a key lookup was attempted)."""

    def __init__(self, retry_after_s: float, limit_class: str | None = None) -> None:
        what = f" ({limit_class} limits fail closed)" if limit_class else ""
        super().__init__(f"quota store unavailable{what}; retry after {retry_after_s:.1f}s")
        self.retry_after_s = retry_after_s
        self.limit_class = limit_class
