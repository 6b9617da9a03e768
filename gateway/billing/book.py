"""The gateway's price list: `pools.NAME.price` from the config, replaced at runtime through
`PUT /admin/prices` (stored in Redis as `sy:prices` with a version, every change audited in
`sy:prices:audit`). Every gateway process re-reads it when its version changes (polled at
most every `poll_s`), as routing settings are. A request is priced by the list it was
admitted under, reserve and settlement alike: a change applies to later requests only.
"""

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from gateway.billing.prices import PoolPrice, prices_from_dict, prices_to_dict

log = logging.getLogger(__name__)

PRICES_KEY = "sy:prices"
AUDIT_KEY = "sy:prices:audit"
AUDIT_LEN = 1000
_RATE_WEIGHT = 0.1  # of each new request in a pool's seconds-per-token average


class PriceBook:
    """Prices per pool, and what a token has cost in engine seconds on each compute-priced
    pool (what a request that reported no seconds is priced at, and what `auto` traffic
    would have cost there)."""

    def __init__(
        self,
        redis: Any,
        configured: Mapping[str, PoolPrice],
        kinds: Mapping[str, str],
        currency: str = "USD",
        poll_s: float = 1.0,
    ) -> None:
        self.redis = redis
        self.kinds = dict(kinds)  # pool name -> kind of server
        self.configured = dict(configured)
        self.prices: dict[str, PoolPrice] = dict(configured)
        self.currency = currency
        self.version = 0  # 0: the config's; else the stored document's
        self.poll_s = poll_s
        self._checked_at = 0.0
        self._seconds_per_token: dict[str, float] = {}

    @property
    def priced(self) -> bool:
        return bool(self.prices)

    def price(self, pool: str) -> PoolPrice | None:
        return self.prices.get(pool)

    def compute_per_token_s(self, pool: str) -> float:
        measured = self._seconds_per_token.get(pool)
        if measured is not None:
            return measured
        price = self.prices.get(pool)
        return price.reserve_compute_s_per_token if price is not None else 0.0

    def observe_compute(self, pool: str, num_tokens: int, seconds: float) -> None:
        """A settled attempt's engine seconds over its tokens, into the pool's average."""
        if num_tokens <= 0 or seconds < 0:
            return
        rate = seconds / num_tokens
        old = self._seconds_per_token.get(pool)
        self._seconds_per_token[pool] = rate if old is None else old + _RATE_WEIGHT * (rate - old)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "currency": self.currency,
            "source": "config" if self.version == 0 else "admin",
            "pools": prices_to_dict(self.prices),
        }

    async def refresh(self, force: bool = False) -> None:
        """Re-read the stored list if its version changed (at most every poll_s); keep the
        last one while Redis is unreachable."""
        now = time.monotonic()
        if not force and now - self._checked_at < self.poll_s:
            return
        self._checked_at = now
        try:
            raw = await self.redis.get(PRICES_KEY)
        except Exception as exc:
            log.warning("prices unavailable, keeping version %d: %r", self.version, exc)
            return
        if raw is None:
            return
        doc = json.loads(raw)
        if doc.get("version", 0) != self.version:
            try:
                self.prices = prices_from_dict(doc.get("pools", {}), self.kinds)
            except ValueError as exc:  # pools this gateway does not serve, say
                log.error("stored prices version %s not applied: %s", doc.get("version"), exc)
                return
            self.version = int(doc["version"])
            log.info("prices version %d applied", self.version)

    async def update(self, pools: object, who: str) -> dict[str, Any]:
        """Validate and store a whole new price list (version + 1), audited. Raises
        ValueError naming the field."""
        await self.refresh(force=True)
        new = prices_from_dict(pools, self.kinds)
        old = self.to_dict()
        self.prices, self.version = new, self.version + 1
        doc = {"version": self.version, "pools": prices_to_dict(new)}
        entry = {"who": who, "when": time.time(), "old": old["pools"], "new": doc["pools"]}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(PRICES_KEY, json.dumps(doc))
            pipe.lpush(AUDIT_KEY, json.dumps(entry))
            pipe.ltrim(AUDIT_KEY, 0, AUDIT_LEN - 1)
            await pipe.execute()
        log.info("prices version %d stored by %s", self.version, who)
        return self.to_dict()

    async def audit(self, limit: int = 50) -> list[dict[str, Any]]:
        return [json.loads(x) for x in await self.redis.lrange(AUDIT_KEY, 0, limit - 1)]
