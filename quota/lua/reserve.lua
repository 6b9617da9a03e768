-- reserve.lua: check one request against a tenant's limits and charge it, all or nothing,
-- on the Redis server clock. KEYS[1..5] carry the tenant's hash tag {t}; KEYS[6] is the
-- owner's (see quota/keyspace.py). Sending it twice charges once: a reservation whose
-- pending marker exists is reported again, not charged again (a retry after a lost reply).
--
-- KEYS[1]  tokens-per-minute counter    sy:{t}:tpm:<minute>
-- KEYS[2]  tokens-per-day counter       sy:{t}:tpd:<day>
-- KEYS[3]  requests-per-minute counter  sy:{t}:rpm:<minute>
-- KEYS[4]  concurrency sorted set       sy:{t}:conc  (member: request id, score: lease end ms)
-- KEYS[5]  pending marker (hash)        sy:{t}:pending:<request id>
-- KEYS[6]  the owner's pending index     sy:owner:{o}:pending (unused when ARGV[13] is "")
-- KEYS[7]  money spent that day          sy:{t}:spend:d:<day>   (nanos; quota/budget.py)
-- KEYS[8]  money spent that month        sy:{t}:spend:m:<month>
-- KEYS[9]  the budget's soft-crossing marker for this period   sy:{t}:soft:<period id>
-- KEYS[10..] a rolling budget's earlier days' spend, sy:{t}:spend:d:<day - i>
-- ARGV[1]  minute index KEYS were built for: floor(unix_s / 60)
-- ARGV[2]  day index KEYS were built for: floor(unix_s / 86400)
-- ARGV[3]  tokens to reserve
-- ARGV[4]  tokens per minute limit    ("" = unlimited)
-- ARGV[5]  tokens per day limit       ("" = unlimited)
-- ARGV[6]  requests per minute limit  ("" = unlimited)
-- ARGV[7]  max concurrent requests    ("" = unlimited: no concurrency accounting)
-- ARGV[8]  request id
-- ARGV[9]  concurrency lease, ms
-- ARGV[10] TTL of minute counters, s
-- ARGV[11] TTL of day counters, s
-- ARGV[12] TTL of the pending marker and of the owner's index, s
-- ARGV[13] owner id: the gateway that will reconcile ("" = none: not indexed)
-- ARGV[14] index member "<tenant>|<request id>"
-- ARGV[15] money to reserve: the request's worst-case cost, nanos ("0" = unpriced)
-- ARGV[16] hard budget, nanos ("" = none)
-- ARGV[17] soft budget, nanos ("" = none)
-- ARGV[18] the budget's period: "day" (KEYS[7]), "month" (KEYS[8]), "rolling" (KEYS[7] and
--          KEYS[10..]); "" = no budget (spend is still counted, nothing is checked)
-- ARGV[19] TTL of a day's spend counter, s;  ARGV[20] of a month's;  ARGV[21] of the marker
--
-- Returns {status, server_s, server_us, tokens_minute, tokens_day, requests_minute,
--          num_concurrent, fail_mask, minute, day, spent, soft_crossed}
--   status  1: admitted; every window charged; counts are after the charge; minute and day
--              are the windows charged (a repeated call: those of the first call).
--   status  0: refused; nothing charged; counts are before; fail_mask bits:
--              1 tokens/minute, 2 tokens/day, 4 requests/minute, 8 concurrency, 16 budget.
--   spent: money spent in the budget's period (nanos; 0 without a budget), after the charge
--          when admitted, else before. soft_crossed: 1 when this reservation took spend to or
--          past the soft budget and no reservation had before in this period, else 0.
--   status -1: ARGV[1..2] are not the server's current windows (a window rolled or the
--              caller's clock is off): nothing done, only {-1, server_s, server_us};
--              the caller rebuilds KEYS from the server time and calls again.

local t = redis.call('TIME')
local sec, usec = tonumber(t[1]), tonumber(t[2])

local function period_spent()
  if ARGV[18] == '' then return 0 end
  if ARGV[18] == 'month' then return tonumber(redis.call('GET', KEYS[8]) or 0) end
  local s = tonumber(redis.call('GET', KEYS[7]) or 0)
  for i = 10, #KEYS do s = s + tonumber(redis.call('GET', KEYS[i]) or 0) end
  return s
end

local held = redis.call('HMGET', KEYS[5], 'minute', 'day')
if held[1] then
  return {1, sec, usec, tonumber(redis.call('GET', KEYS[1]) or 0),
          tonumber(redis.call('GET', KEYS[2]) or 0), tonumber(redis.call('GET', KEYS[3]) or 0),
          redis.call('ZCARD', KEYS[4]), 0, tonumber(held[1]), tonumber(held[2]), period_spent(), 0}
end

if math.floor(sec / 60) ~= tonumber(ARGV[1]) or math.floor(sec / 86400) ~= tonumber(ARGV[2]) then
  return {-1, sec, usec}
end

local function limit(arg)
  if arg == '' then return nil end
  return tonumber(arg)
end

local tokens = tonumber(ARGV[3])
local tpm, tpd, rpm, max_conc = limit(ARGV[4]), limit(ARGV[5]), limit(ARGV[6]), limit(ARGV[7])
local used_tpm = tonumber(redis.call('GET', KEYS[1]) or 0)
local used_tpd = tonumber(redis.call('GET', KEYS[2]) or 0)
local used_rpm = tonumber(redis.call('GET', KEYS[3]) or 0)
local now_ms = sec * 1000 + math.floor(usec / 1000)

local num_conc = 0
if max_conc then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', string.format('%d', now_ms))
  num_conc = redis.call('ZCARD', KEYS[4])
end

local cost = tonumber(ARGV[15])
local hard, soft = limit(ARGV[16]), limit(ARGV[17])
local spent = period_spent()

local mask = 0
if tpm and used_tpm + tokens > tpm then mask = mask + 1 end
if tpd and used_tpd + tokens > tpd then mask = mask + 2 end
if rpm and used_rpm + 1 > rpm then mask = mask + 4 end
if max_conc and num_conc + 1 > max_conc then mask = mask + 8 end
if hard and cost > 0 and spent + cost > hard then mask = mask + 16 end
if mask ~= 0 then
  return {0, sec, usec, used_tpm, used_tpd, used_rpm, num_conc, mask, ARGV[1], ARGV[2], spent, 0}
end

local crossed = 0
if cost > 0 then
  redis.call('INCRBY', KEYS[7], ARGV[15])
  redis.call('EXPIRE', KEYS[7], ARGV[19])
  redis.call('INCRBY', KEYS[8], ARGV[15])
  redis.call('EXPIRE', KEYS[8], ARGV[20])
  if soft and spent < soft and spent + cost >= soft
      and redis.call('SET', KEYS[9], '1', 'NX', 'EX', ARGV[21]) then
    crossed = 1
  end
  if ARGV[18] ~= '' then spent = spent + cost end
end

used_tpm = redis.call('INCRBY', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[10])
used_tpd = redis.call('INCRBY', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[11])
used_rpm = redis.call('INCR', KEYS[3])
redis.call('EXPIRE', KEYS[3], ARGV[10])
if max_conc then
  local lease_ms = tonumber(ARGV[9])
  redis.call('ZADD', KEYS[4], string.format('%d', now_ms + lease_ms), ARGV[8])
  redis.call('PEXPIRE', KEYS[4], ARGV[9])
  num_conc = redis.call('ZCARD', KEYS[4])
end
redis.call('HSET', KEYS[5], 'owner', ARGV[13], 'tokens', ARGV[3], 'minute', ARGV[1],
           'day', ARGV[2], 'cost', ARGV[15])
redis.call('EXPIRE', KEYS[5], ARGV[12])
if ARGV[13] ~= '' then
  redis.call('ZADD', KEYS[6], now_ms, ARGV[14])
  redis.call('EXPIRE', KEYS[6], ARGV[12])
end
return {1, sec, usec, used_tpm, used_tpd, used_rpm, num_conc, 0, ARGV[1], ARGV[2], spent, crossed}
