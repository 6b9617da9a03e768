"""The operator's shadow budget (`shadow_tokens_per_minute`, over every replica), shared
fairly among the tenants that ask for shadow runs.

Each minute the budget is split max-min fair over the tenants' demand (`fair_shares`): a
tenant asking for less than an equal share gets what it asks, the rest is split evenly
among the others. So a tenant alone can use all of it, and a heavy tenant cannot spend the
share of a lighter one. A tenant's demand for the minute (`demands_of`) is what it asked
for so far in it (granted or not) plus, for the part of the minute still to come, what it
asked for in the whole last minute; a tenant that asked nothing last minute wants as much
as it can get, so it has an equal share from its first ask on, even when another tenant had
the budget to itself until then (if that one already spent it all, the newcomer's share
comes with the next minute). A run is granted (`may_take`) while the minute's budget has
room for it and it fits in the tenant's share, or it is the tenant's first of the minute
(a share smaller than one run still gets a run, first come). Runs are whole, so up to one
run's worth per tenant may go unused at a minute's end.

The decision and the charge are one Lua script (`TAKE_LUA`, the arithmetic of the
functions here), so gateways sharing the Redis never grant past the limit or a share
between them.

Keys (one hash tag, `{shadow}`), per minute m, expiring after three minutes:
- `sy:{shadow}:asked:<m>`: hash, tenant -> tokens asked for;
- `sy:{shadow}:used:<m>`: hash, tenant -> tokens granted;
- `sy:{shadow}:total:<m>`: tokens granted to every tenant.
"""

import math
from collections.abc import Mapping
from typing import Any

KEY = "sy:{shadow}:"
TTL_S = 180

# KEYS[1] asked this minute and KEYS[2] asked last minute (hashes, tenant -> tokens),
# KEYS[3] granted this minute (hash, tenant -> tokens), KEYS[4] granted to every tenant
# this minute. ARGV[1] the tenant, ARGV[2] the run's tokens, ARGV[3] the limit, ARGV[4] the
# part of the minute still to come (0..1], ARGV[5] seconds the keys are kept.
# Returns 1 (granted and charged) or 0 (nothing charged; the ask still counts as demand).
TAKE_LUA = """
local tenant, tokens, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local to_come = tonumber(ARGV[4])
redis.call('HINCRBY', KEYS[1], tenant, tokens)
redis.call('EXPIRE', KEYS[1], ARGV[5])
local function map(flat)
  local m = {}
  for i = 1, #flat, 2 do m[flat[i]] = tonumber(flat[i + 1]) end
  return m
end
local asked, last = map(redis.call('HGETALL', KEYS[1])), map(redis.call('HGETALL', KEYS[2]))
local demands = {}
for t, a in pairs(asked) do
  local d = math.huge
  if last[t] then d = a + last[t] * to_come end
  demands[#demands + 1] = {t, d}
end
for t, b in pairs(last) do
  if not asked[t] then demands[#demands + 1] = {t, b * to_come} end
end
table.sort(demands, function(x, y) return x[2] < y[2] end)
local left, share = limit, 0
for i, d in ipairs(demands) do
  local s = math.min(d[2], left / (#demands - i + 1))
  if d[1] == tenant then share = s break end
  left = left - s
end
local mine = tonumber(redis.call('HGET', KEYS[3], tenant) or 0)
local total = tonumber(redis.call('GET', KEYS[4]) or 0)
if total + tokens > limit or (mine > 0 and mine + tokens > share) then return 0 end
redis.call('HINCRBY', KEYS[3], tenant, tokens)
redis.call('EXPIRE', KEYS[3], ARGV[5])
redis.call('INCRBY', KEYS[4], tokens)
redis.call('EXPIRE', KEYS[4], ARGV[5])
return 1
"""


def fair_shares(limit: float, demands: Mapping[str, float]) -> dict[str, float]:
    """Max-min fair split of `limit` over `demands` (math.inf: as much as it can get): the
    smallest demands are met in full while they are under an equal share of what is left."""
    shares: dict[str, float] = {}
    left = float(limit)
    ordered = sorted(demands.items(), key=lambda item: item[1])
    for i, (tenant, demand) in enumerate(ordered):
        shares[tenant] = min(demand, left / (len(ordered) - i))
        left -= shares[tenant]
    return shares


def demands_of(
    asked_now: Mapping[str, int], asked_last: Mapping[str, int], to_come: float
) -> dict[str, float]:
    """Each tenant's demand for this minute: what it asked for so far, plus last minute's
    asks scaled to the part of this minute still to come (0..1]; math.inf for a tenant
    that asked nothing last minute."""
    demands = {
        tenant: asked + asked_last[tenant] * to_come if tenant in asked_last else math.inf
        for tenant, asked in asked_now.items()
    }
    for tenant, asked in asked_last.items():
        demands.setdefault(tenant, asked * to_come)
    return demands


def may_take(tokens: int, mine: int, share: float, total: int, limit: int) -> bool:
    """A run of `tokens` fits: the minute's `total` stays within `limit`, and the tenant's
    granted tokens (`mine`) within its share, unless it is the tenant's first run."""
    return total + tokens <= limit and (mine == 0 or mine + tokens <= share)


class ShadowBudget:
    """The shared budget in Redis; one per gateway process."""

    def __init__(self, redis: Any) -> None:
        self._take = redis.register_script(TAKE_LUA)

    async def take(self, tenant: str, tokens: int, limit: int, now_s: float) -> bool:
        """Charge `tokens` of `tenant`'s shadow run to the budget of the minute of `now_s`
        (unix seconds) if it may take them; False (nothing charged) if not."""
        minutes = now_s / 60
        minute = math.floor(minutes)
        keys = [f"{KEY}asked:{minute}", f"{KEY}asked:{minute - 1}"]
        keys += [f"{KEY}used:{minute}", f"{KEY}total:{minute}"]
        to_come = repr(1.0 - (minutes - minute))
        granted = await self._take(keys=keys, args=[tenant, tokens, limit, to_come, TTL_S])
        return bool(granted)
