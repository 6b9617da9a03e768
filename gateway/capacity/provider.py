"""A hosted pool's provider limits: the tokens-per-minute budget the operator configured
for it (`UpstreamConfig.tokens_per_minute`), and what the provider says on its answers.

A hosted API (OpenAI and those that copy its headers) answers with `x-ratelimit-remaining-
requests` / `-tokens` and `x-ratelimit-reset-requests` / `-tokens` (durations such as
`1s`, `6m0s`, `20ms`), and refuses past them with 429 and `Retry-After`. Sending more then
only collects 429s; so the gateway refuses at admission instead, with the provider's own
wait as Retry-After (`ProviderLimited`, a 503 to the client: its own quota is not the
cause). The budget counts a request as its prompt plus `max_tokens` when admitted, as the
providers count it; a gateway process of a group of N holds 1/N of it.
"""

import math
import re
from collections import deque
from collections.abc import Callable, Mapping

from gateway.capacity.refusals import OverCapacity

WINDOW_S = 60.0
MAX_PROVIDER_WAIT_S = 900.0  # a reset or Retry-After beyond this is not believed
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class ProviderLimited(OverCapacity):
    """The pool's provider would refuse this request now (its budget, or its word)."""

    def __init__(self, pool: str, why: str, retry_after_s: float) -> None:
        super().__init__(pool, None, math.inf, retry_after_s)
        self.args = (f"{pool} is at its provider's limit: {why}",)
        self.why = why


def parse_duration(text: str | None) -> float | None:
    """Seconds of `6m0s`, `1.5s`, `20ms` or a bare number of seconds; None: not one."""
    if not text:
        return None
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            return None
        value = sum(float(n) * _UNIT_S[u] for n, u in parts)
    if not math.isfinite(value) or value < 0:
        return None
    return min(value, MAX_PROVIDER_WAIT_S)


def _count(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value >= 0 else None


class ProviderLimits:
    """One pool's view of its provider's limits (the pool's clock, seconds)."""

    def __init__(
        self, tokens_per_minute: int | None, clock: Callable[[], float], share: float = 1.0
    ) -> None:
        self.budget = None if tokens_per_minute is None else max(1, int(tokens_per_minute * share))
        self.clock = clock
        self._spent: deque[tuple[float, int]] = deque()  # (admitted at, tokens)
        self._spent_tokens = 0
        self.blocked_until = 0.0  # the provider said: nothing until then (429, 0 requests left)
        self.block_reason = ""
        self.tokens_left: int | None = None  # the provider's word, until `tokens_reset_at`
        self.tokens_reset_at = 0.0

    def _expire(self, now: float) -> None:
        while self._spent and now - self._spent[0][0] >= WINDOW_S:
            self._spent_tokens -= self._spent.popleft()[1]

    def wait_s(self, tokens: int) -> tuple[float, str]:
        """(seconds until a request of `tokens` may be sent, why); 0.0 when it may now."""
        now = self.clock()
        if now < self.blocked_until:
            return self.blocked_until - now, self.block_reason
        if (
            self.tokens_left is not None
            and now < self.tokens_reset_at
            and tokens > self.tokens_left
        ):
            return self.tokens_reset_at - now, f"{self.tokens_left} tokens left until its reset"
        if self.budget is None:
            return 0.0, ""
        self._expire(now)
        if tokens > self.budget:
            return WINDOW_S, f"{tokens} tokens is more than its budget of {self.budget} a minute"
        over = self._spent_tokens + tokens - self.budget
        if over <= 0:
            return 0.0, ""
        freed = 0
        for at, spent in self._spent:  # oldest first: when enough of the window has expired
            freed += spent
            if freed >= over:
                return max(
                    0.001, at + WINDOW_S - now
                ), f"its budget of {self.budget} tokens a minute"
        return WINDOW_S, f"its budget of {self.budget} tokens a minute"

    def charge(self, tokens: int) -> None:
        """A request of `tokens` was admitted: it counts against the window."""
        now = self.clock()
        if self.budget is not None:
            self._spent.append((now, tokens))
            self._spent_tokens += tokens
        if self.tokens_left is not None and now < self.tokens_reset_at:
            self.tokens_left = max(0, self.tokens_left - tokens)

    def note_answer(self, status: int, headers: Mapping[str, str]) -> None:
        """What an answer's head says of the provider's limits."""
        now = self.clock()
        if status == 429:
            wait = parse_duration(headers.get("retry-after"))
            if wait is None:
                ms = _count(headers.get("retry-after-ms"))
                wait = None if ms is None else min(ms / 1000, MAX_PROVIDER_WAIT_S)
            self._block(now, wait if wait is not None else 1.0, "it answered 429")
        requests_left = _count(headers.get("x-ratelimit-remaining-requests"))
        if requests_left == 0:
            reset = parse_duration(headers.get("x-ratelimit-reset-requests"))
            self._block(
                now, reset if reset is not None else 1.0, "no requests left until its reset"
            )
        tokens_left = _count(headers.get("x-ratelimit-remaining-tokens"))
        if tokens_left is not None:
            reset = parse_duration(headers.get("x-ratelimit-reset-tokens"))
            self.tokens_left = tokens_left
            self.tokens_reset_at = now + (reset if reset is not None else 1.0)

    def _block(self, now: float, wait_s: float, why: str) -> None:
        if now + wait_s > self.blocked_until:
            self.blocked_until, self.block_reason = now + wait_s, why
