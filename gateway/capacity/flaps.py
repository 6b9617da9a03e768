"""Hysteresis for members that flap between `stalled` and `ready`.

A worker reports `stalled` when its engine makes no progress it should be making
(workers/server/stall.py). One that comes back is not trusted at once: it stays out of
the rotation until it has reported `ready` for a hold in a row, and the hold doubles with
each stall that follows within `reset_s` of the last one (a replica that flaps is held
longer each time; one that recovered for good is forgiven after `reset_s`). The gateway's
pool keeps its view `stalled` while it is held, so no request is sent there and waiters
on it retry elsewhere, exactly as for a stall. Pure: the caller passes its clock.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FlapPolicy:
    hold_s: float = 2.0  # the first hold after a stall
    max_hold_s: float = 30.0  # the hold doubles per flap up to this
    reset_s: float = 60.0  # no stall for this long: the flap count starts again


@dataclass
class _Member:
    flaps: int = 0  # stalls within reset_s of the previous one
    last_stall: float = -1e18
    stalled: bool = False
    ready_since: float | None = None  # reporting ready again, since then


@dataclass
class FlapGuard:
    """`state(url, reported, now)` is the state to act on: the reported one, except that a
    member recovering from a stall stays `stalled` until its hold has passed."""

    policy: FlapPolicy = field(default_factory=FlapPolicy)
    _members: dict[str, _Member] = field(default_factory=dict)

    def hold_s(self, url: str) -> float:
        """The hold the member's next recovery must wait out."""
        member = self._members.get(url)
        flaps = member.flaps if member else 1
        return min(self.policy.hold_s * 2 ** max(flaps - 1, 0), self.policy.max_hold_s)

    def held(self, url: str) -> bool:
        member = self._members.get(url)
        return member is not None and member.stalled

    def state(self, url: str, reported: str, now: float) -> str:
        member = self._members.get(url)
        if reported == "stalled":
            if member is None:
                member = self._members[url] = _Member()
            if not member.stalled:
                recent = now - member.last_stall <= self.policy.reset_s
                member.flaps = member.flaps + 1 if recent else 1
                member.stalled = True
            member.last_stall = now
            member.ready_since = None
            return "stalled"
        if member is None or not member.stalled:
            return reported
        if reported != "ready":
            member.ready_since = None
            return reported if reported in ("unreachable", "draining") else "stalled"
        if member.ready_since is None:
            member.ready_since = now
        if now - member.ready_since < self.hold_s(url):
            return "stalled"
        member.stalled = False
        member.ready_since = None
        return "ready"

    def forget(self, url: str) -> None:
        self._members.pop(url, None)
