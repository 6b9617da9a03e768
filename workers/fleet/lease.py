"""The leader lease's policy: which supervisor gives the fleet's orders, and until when.

Pure: no Redis, no clock of its own. `LeaseHolder` is one contender's view of the lease,
moved by the outcomes of its Redis calls (`workers.fleet.coordination`) and the clock
readings taken when each call was sent. `Fence` is the receiving side of fencing.

The lease is one Redis key set with NX and an expiry of `ttl_s`; taking it hands out a
fencing token (a counter INCR'd at each take, never reused). The holder renews every
`ttl_s / 3`; a renewal that finds the key gone or held by another loses the lease at
once. Its own clock says it is leader only until `ttl_s - margin_s` after it *sent* the
call that last set the expiry, so it stops acting before the key can expire on the
server even when the reply came late. A contender that finds the key held tries again
when the key would expire (its remaining time, from the reply), so a leader that dies
is replaced within `ttl_s` of its last renewal, which came at most `ttl_s / 3` before.

Every order a leader writes carries its token, and Redis refuses an order whose token is
below the highest handed out (a leader that paused past its lease and woke up still
believing it leads gives no order that lands).
"""

from dataclasses import dataclass
from typing import Literal

Action = Literal["acquire", "renew"]


@dataclass(frozen=True)
class LeaseConfig:
    ttl_s: float = 6.0  # the key's expiry, set at each take and renewal
    # The holder counts itself leader until ttl_s - margin_s after it sent the call that
    # set the expiry: room for the two clocks' drift over one ttl.
    margin_s: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.margin_s < self.ttl_s / 3:
            raise ValueError(f"need 0 <= margin_s < ttl_s / 3, got {self}")

    @property
    def ttl_ms(self) -> int:
        return max(int(self.ttl_s * 1000), 1)

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3


class LeaseHolder:
    """One contender's view of the lease. Call `due(now)` on every pass of the lease loop;
    when it names an action, send it and report the outcome with the clock reading taken
    just before sending (`sent_at_s`)."""

    def __init__(self, config: LeaseConfig, holder_id: str) -> None:
        self.config = config
        self.holder_id = holder_id
        self.token: int | None = None  # held: the fencing token; None: not leader
        self.valid_until_s = 0.0  # leader (on this clock) until then
        self.next_attempt_s = 0.0  # when `due` next names an action
        self.acquired_at_s: float | None = None  # this tenure began (for a new leader's hold)
        self.num_acquired = 0
        self.num_lost = 0

    def is_leader(self, now_s: float) -> bool:
        return self.token is not None and now_s < self.valid_until_s

    def due(self, now_s: float) -> Action | None:
        """What to send now: `acquire` (not leader), `renew` (leader), or None (wait until
        `next_attempt_s`). A lease whose local validity ran out is dropped here."""
        if self.token is not None and now_s >= self.valid_until_s:
            self._lose()
        if now_s < self.next_attempt_s:
            return None
        return "renew" if self.token is not None else "acquire"

    def acquired(self, token: int, sent_at_s: float) -> None:
        self.token = token
        self.acquired_at_s = sent_at_s
        self.num_acquired += 1
        self._held_from(sent_at_s)

    def refused(self, sent_at_s: float, remaining_s: float | None) -> None:
        """Another holds the key for `remaining_s` more (None: unknown): try when it would
        expire, and at least every renew interval (a released key is taken at once)."""
        wait_s = self.config.renew_every_s
        if remaining_s is not None and remaining_s >= 0:
            wait_s = min(wait_s, remaining_s + 0.001)
        self.next_attempt_s = sent_at_s + wait_s

    def renewed(self, sent_at_s: float) -> None:
        self._held_from(sent_at_s)

    def renewal_refused(self) -> None:
        """The key is gone or another's: not leader from now."""
        self._lose()
        self.next_attempt_s = 0.0

    def failed(self, sent_at_s: float) -> None:
        """The call did not complete (Redis unreachable). Leader still until its validity
        ends; try again soon."""
        self.next_attempt_s = sent_at_s + min(self.config.renew_every_s / 4, 0.5)

    def released(self) -> None:
        self._lose()

    def tenure_s(self, now_s: float) -> float:
        """How long this holder has led without a break (0: not leader)."""
        if not self.is_leader(now_s) or self.acquired_at_s is None:
            return 0.0
        return now_s - self.acquired_at_s

    def _held_from(self, sent_at_s: float) -> None:
        self.valid_until_s = sent_at_s + self.config.ttl_s - self.config.margin_s
        self.next_attempt_s = sent_at_s + self.config.renew_every_s

    def _lose(self) -> None:
        if self.token is not None:
            self.num_lost += 1
        self.token = None
        self.acquired_at_s = None
        self.valid_until_s = 0.0


class Fence:
    """The receiving side of fencing: the highest token accepted so far; an order with a
    lower one comes from a leader that has since been replaced and is refused."""

    def __init__(self) -> None:
        self.highest = 0
        self.num_refused = 0

    def admit(self, token: int) -> bool:
        if token < self.highest:
            self.num_refused += 1
            return False
        self.highest = token
        return True
