"""Admission by tenant at the gateway's door, for when the gateway itself is the bottleneck.

The fair queue (`gateway.capacity.fair_queue`) shares the workers' slots among tenants, but a
request reaches it only after the gateway has spent most of its CPU on it (routing, the body,
tokens, the quota). When the gateway process (or the machine, or Redis) is saturated,
requests wait in front of the fair queue in arrival order, and a tenant that sends ten
times more takes ten times more of the gateway. The door runs first, as an ASGI middleware
in front of the app:

- it knows the caller's tenant from the key cache (`Gateway.known_keys`, filled by
  authentication), from the `authorization` header alone: no body, no Redis;
- `Shares` counts admissions per tenant over the last `window_s`: with several tenants
  active, one admitted more than `admitted / active tenants` is over its share;
- the `Gate` lets a tenant under its share in at once, and holds the tenants over their
  share to `limit` requests in flight between them, the rest waiting in their tenant's
  lane. `limit` follows the latency the under-share tenants see from the gateway (arrival
  to quota reservation, fed by the handler): it halves while that latency is more than
  `tolerance_s` over the gateway's floor, and grows back by one per tick otherwise. So a
  flood is held back only as far as the others' latency needs, and a tenant alone (or
  every tenant within its share) is never held.

A request that waited `max_wait_s` in its lane, or found it full, is refused: 429
`gateway_busy` with a jittered Retry-After, held `refusal_delay_s` first. Keys the cache
does not know pass (the handler authenticates them, and fills the cache).

A key is hashed once per request, by `key_digest`: the door leaves the digest in the ASGI
scope (`KEY_DIGEST`), where authentication takes it.
"""

import asyncio
import hashlib
import json
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]

# Every path a tenant's key calls is under /v1/ (completions, chat, usage, models,
# feedback): each request takes a share of the gateway (/v1/usage several Redis round
# trips), so each is counted and, over its share, held.
_GUARDED_PREFIX = "/v1/"
KEY_DIGEST = "switchyard.key_digest"  # the scope entry: the request's bearer key, hashed


def key_digest(authorization: bytes) -> bytes | None:
    """The digest the key cache (`Gateway.known_keys`) knows a bearer key by: blake2b-16 of
    the key in an `authorization` header's value. None: not a bearer key."""
    if authorization[:7].lower() != b"bearer ":
        return None
    return hashlib.blake2b(authorization[7:].strip(), digest_size=16).digest()


class LoopMonitor:
    """The event loop's lag: how late a timer of period `interval_s` fires, smoothed.
    `on_tick` is called with it on every tick (the gate's clock, the lag metric)."""

    def __init__(
        self,
        interval_s: float = 0.02,
        smoothing: float = 0.3,
        on_tick: Callable[[float], object] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.smoothing = smoothing
        self.on_tick = on_tick
        self.lag_s = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + self.interval_s
        self._handle = loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        lag = max(0.0, now - self._due)
        self.lag_s += self.smoothing * (lag - self.lag_s)
        if self.on_tick is not None:
            self.on_tick(self.lag_s)
        self._due = now + self.interval_s
        self._handle = loop.call_at(self._due, self._tick)


class Shares:
    """Admissions per tenant over the last `window_s`. Pure bookkeeping; injected clock.

    A tenant is active while it was admitted or asked within the window.
    """

    def __init__(self, window_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._admitted: deque[tuple[float, str]] = deque()  # (when, tenant), oldest first
        self._counts: dict[str, int] = {}  # admitted per tenant within the window
        self._last_seen: dict[str, float] = {}

    def asked(self, tenant_id: str) -> None:
        self._last_seen[tenant_id] = self._clock()

    def count(self, tenant_id: str) -> None:
        """One admission of `tenant_id`, now."""
        now = self._clock()
        self._last_seen[tenant_id] = now
        self._admitted.append((now, tenant_id))
        self._counts[tenant_id] = self._counts.get(tenant_id, 0) + 1

    def share(self) -> float | None:
        """An equal share of the window's admissions; None while under two tenants are
        active (nobody is over a share then)."""
        active = self.active_tenants()
        return len(self._admitted) / active if active > 1 else None

    def over_share(self, tenant_id: str, share: float | None = None) -> bool:
        """Whether `tenant_id` was admitted more than its share (`share()`, computed here
        unless given)."""
        share = self.share() if share is None else share
        return share is not None and self._counts.get(tenant_id, 0) > share

    def active_tenants(self) -> int:
        self._expire(self._clock())
        return len(self._last_seen)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        admitted = self._admitted
        while admitted and admitted[0][0] < horizon:
            _, tenant = admitted.popleft()
            left = self._counts[tenant] - 1
            if left:
                self._counts[tenant] = left
            else:
                del self._counts[tenant]
        if len(self._last_seen) > len(self._counts):
            for tenant, seen in list(self._last_seen.items()):
                if seen < horizon and tenant not in self._counts:
                    del self._last_seen[tenant]


class Gate:
    """Holds back the tenants over their share while the others' latency suffers.

    A tenant under its share (`Shares`) enters at once. The tenants over their share may
    have `limit` requests in flight between them; the rest wait in their tenant's lane
    (lanes served round-robin) for up to `max_wait_s`, and are refused past it or past
    `lane_max` waiting. A tenant alone is never held.

    `limit` follows the gateway's own latency (`observe`: a request's arrival to its quota
    reservation). The floor is the lowest sample of any tenant in `floor_window_s`. On each
    `tick`, while the moving mean of the under-share tenants' samples is over the floor
    plus `tolerance_s`, the limit halves (from at most what the over-share tenants have in
    flight); otherwise it grows by one while someone waits, or with no under-share sample
    in the last `window_s`.
    """

    def __init__(
        self,
        *,
        tolerance_s: float = 0.001,
        max_limit: int = 1024,
        floor_window_s: float = 300.0,
        lane_max: int = 1024,
        max_wait_s: float = 2.0,
        window_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shares = Shares(window_s, clock)
        self.tolerance_s, self.floor_window_s = tolerance_s, floor_window_s
        self.max_limit = max_limit
        self.limit = float(max_limit)
        self.lane_max, self.max_wait_s = lane_max, max_wait_s
        self._clock = clock
        self.in_flight: dict[str, int] = {}
        self._lanes: dict[str, deque[asyncio.Future[bool]]] = {}  # tenants with waiters
        self._mean: float | None = None  # moving mean of the under-share samples
        self._last_sample = float("-inf")
        self._floor: deque[tuple[float, float]] = deque()  # (when, sample): a sliding min

    @property
    def waiting(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    def over_in_flight(self) -> int:
        """Requests in flight of the tenants now over their share."""
        share = self.shares.share()
        if share is None:
            return 0
        return sum(n for t, n in self.in_flight.items() if self.shares.over_share(t, share))

    async def enter(self, tenant: str) -> bool:
        """True once a request of `tenant` is in (call `leave` when it is done); False
        when it is refused."""
        self.shares.asked(tenant)
        if tenant not in self._lanes and (
            not self.shares.over_share(tenant) or self.over_in_flight() < self.limit
        ):
            self._let_one_in(tenant)
            return True
        lane = self._lanes.setdefault(tenant, deque())
        if len(lane) >= self.lane_max:
            return False
        turn: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        lane.append(turn)
        try:
            return await asyncio.wait_for(asyncio.shield(turn), self.max_wait_s)
        except TimeoutError:
            if turn.done():  # let in just as the wait ran out: give the place back
                self.leave(tenant)
            turn.cancel()
            return False
        finally:
            if turn in lane:
                lane.remove(turn)
            if not lane and self._lanes.get(tenant) is lane:
                del self._lanes[tenant]

    def leave(self, tenant: str) -> None:
        left = self.in_flight[tenant] - 1
        if left:
            self.in_flight[tenant] = left
        else:
            del self.in_flight[tenant]
        self._serve_lanes()

    def observe(self, tenant: str, latency_s: float) -> None:
        """A request's time from arrival to its quota reservation."""
        now = self._clock()
        floor = self._floor
        while floor and floor[-1][1] >= latency_s:
            floor.pop()
        floor.append((now, latency_s))
        while floor[0][0] < now - self.floor_window_s:
            floor.popleft()
        if not self.shares.over_share(tenant):
            mean = self._mean
            self._mean = latency_s if mean is None else 0.7 * mean + 0.3 * latency_s
            self._last_sample = now

    def tick(self) -> None:
        """Adapt the limit (the loop monitor's period), then let waiters in."""
        recent = self._clock() - self._last_sample < self.shares.window_s
        mean = self._mean
        if recent and mean is not None and mean > self._floor[0][1] + self.tolerance_s:
            self.limit = max(1.0, min(self.limit, self.over_in_flight()) / 2)
        elif self._lanes or not recent:
            self.limit = min(float(self.max_limit), self.limit + 1)
        self._serve_lanes()

    def _let_one_in(self, tenant: str) -> None:
        self.shares.count(tenant)
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1

    def _serve_lanes(self) -> None:
        """Round-robin over the lanes while a waiter may enter."""
        for tenant in list(self._lanes):
            lane = self._lanes[tenant]
            while lane and lane[0].done():
                lane.popleft()
            if lane and (not self.shares.over_share(tenant) or self.over_in_flight() < self.limit):
                self._let_one_in(tenant)
                lane.popleft().set_result(True)
                del self._lanes[tenant]
                if lane:
                    self._lanes[tenant] = lane  # served: to the back of the round
            elif not lane:
                del self._lanes[tenant]


def _refusal(rng: random.Random, retry_after_s: float) -> tuple[dict, bytes]:
    body = {
        "error": {
            "message": "the gateway is saturated and this tenant is over its share of it; "
            "retry after the Retry-After interval",
            "type": "rate_limit_error",
            "param": None,
            "code": "gateway_busy",
        }
    }
    wait = retry_after_s * (1.0 + rng.random())
    start = {
        "type": "http.response.start",
        "status": 429,
        "headers": [
            (b"content-type", b"application/json"),
            (b"retry-after", str(max(1, round(wait))).encode()),
        ],
    }
    return start, json.dumps(body).encode()


def door_middleware(
    app: ASGIApp,
    gate: Gate,
    tenant_of_digest: Callable[[bytes], str | None],
    *,
    on_refusal: Callable[[str], None] | None = None,
    rng: random.Random | None = None,
    retry_after_s: float = 1.0,
    refusal_delay_s: float = 0.0,
) -> ASGIApp:
    """`app` behind the door. `tenant_of_digest`: the tenant of a key's `key_digest`, if the
    key is known; the digest is left in the scope under `KEY_DIGEST` for authentication.
    `on_refusal(tenant)`: counts refusals.
    `refusal_delay_s`: how long a refusal is held before it is sent. A client that retries
    at once, ignoring Retry-After, would otherwise keep the loop busy with refusals alone;
    held, each of its connections costs one timer per `refusal_delay_s`."""
    rng = rng or random.Random()

    async def guarded(scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(_GUARDED_PREFIX):
            return await app(scope, receive, send)
        tenant = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                digest = key_digest(value)
                if digest is not None:
                    scope[KEY_DIGEST] = digest
                    tenant = tenant_of_digest(digest)
                break
        if tenant is None:
            return await app(scope, receive, send)
        if await gate.enter(tenant):
            try:
                return await app(scope, receive, send)
            finally:
                gate.leave(tenant)
        if on_refusal is not None:
            on_refusal(tenant)
        if refusal_delay_s > 0:
            await asyncio.sleep(refusal_delay_s)
        start, body = _refusal(rng, retry_after_s)
        await send(start)
        await send({"type": "http.response.body", "body": body})

    return guarded
