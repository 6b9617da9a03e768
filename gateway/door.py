"""Admission by tenant at the gateway's door, for when the gateway itself is the bottleneck.

The fair queue (`gateway.admission`) shares the workers' slots among tenants, but a request
reaches it only after the gateway has spent most of its CPU on it (routing, the body,
tokens, the quota). When the gateway's own event loop is saturated, requests wait in front
of the fair queue in arrival order, and a tenant that sends ten times more takes ten times
more of the gateway. The door runs first, as an ASGI middleware in front of the app:

- it knows the caller's tenant from the key cache (`Gateway.known_keys`, filled by
  authentication), from the `authorization` header alone: no body, no Redis;
- a `LoopMonitor` measures the event loop's lag (a timer's lateness); the gateway is
  saturated while the smoothed lag is over `lag_threshold_s`;
- while it is saturated and several tenants are active, a tenant that was admitted more
  than its share (admitted requests in the last `window_s` over the active tenants) is
  refused at once: 429 `gateway_busy` with a jittered Retry-After, a few microseconds of
  work. Tenants under their share pass, so a light tenant never waits behind a flood. It
  is work-conserving: with spare CPU, or one tenant, nobody is refused here, so a flooding
  tenant is held back only as long as the loop stays saturated, and takes what the others
  leave.

Keys the cache does not know pass (the handler authenticates them, and fills the cache).
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

_GUARDED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class LoopMonitor:
    """The event loop's lag: how late a timer of period `interval_s` fires, smoothed."""

    def __init__(
        self,
        interval_s: float = 0.02,
        smoothing: float = 0.3,
        on_tick: Callable[[float], object] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.smoothing = smoothing
        self.on_tick = on_tick  # called with the smoothed lag (a metric's setter)
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


class Door:
    """Per-tenant shares of a saturated gateway. Pure bookkeeping; the clock is injected.

    `saturated()`: whether the gateway has no spare CPU now (the loop monitor's verdict).
    `window_s`: how far back admissions count, and how long a tenant stays active after
    its last request. `min_rate_per_s`: below this many admissions a second the lag is not
    the requests' doing (a busy machine, a slow callback) and nobody is refused.
    """

    def __init__(
        self,
        saturated: Callable[[], bool],
        window_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        min_rate_per_s: float = 100.0,
    ) -> None:
        self._saturated = saturated
        self.window_s = window_s
        self._min_admitted = min_rate_per_s * window_s
        self._clock = clock
        self._admitted: deque[tuple[float, str]] = deque()  # (when, tenant), oldest first
        self._counts: dict[str, int] = {}  # admitted per tenant within the window
        self._last_seen: dict[str, float] = {}

    def admit(self, tenant_id: str) -> bool:
        """Whether a request of `tenant_id` may come in now; counted in if so."""
        now = self._clock()
        self._expire(now)
        self._last_seen[tenant_id] = now
        if (
            len(self._last_seen) > 1
            and len(self._admitted) >= self._min_admitted
            and self._saturated()
        ):
            share = len(self._admitted) / len(self._last_seen)
            if self._counts.get(tenant_id, 0) > share:
                return False
        self._admitted.append((now, tenant_id))
        self._counts[tenant_id] = self._counts.get(tenant_id, 0) + 1
        return True

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
    door: Door,
    tenant_of_digest: Callable[[bytes], str | None],
    *,
    on_refusal: Callable[[str], None] | None = None,
    rng: random.Random | None = None,
    retry_after_s: float = 1.0,
    refusal_delay_s: float = 0.0,
) -> ASGIApp:
    """`app` behind the door. `tenant_of_digest`: the tenant of a key's blake2b-16 digest,
    if the key is known (see `gateway.intake`); `on_refusal(tenant)`: counts refusals.
    `refusal_delay_s`: how long a refusal is held before it is sent. A client that retries
    at once, ignoring Retry-After, would otherwise keep the loop busy with refusals alone;
    held, each of its connections costs one timer per `refusal_delay_s`."""
    rng = rng or random.Random()

    async def guarded(scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] not in _GUARDED_PATHS:
            return await app(scope, receive, send)
        tenant = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                if value[:7].lower() == b"bearer ":
                    plaintext = value[7:].strip()
                    digest = hashlib.blake2b(plaintext, digest_size=16).digest()
                    tenant = tenant_of_digest(digest)
                break
        if tenant is None or door.admit(tenant):
            return await app(scope, receive, send)
        if on_refusal is not None:
            on_refusal(tenant)
        if refusal_delay_s > 0:
            await asyncio.sleep(refusal_delay_s)
        start, body = _refusal(rng, retry_after_s)
        await send(start)
        await send({"type": "http.response.body", "body": body})

    return guarded
