-- reconcile.lua: settle one request to the tokens it actually used, exactly once.
-- KEYS are the windows the request was charged to, never the current ones, so a reconcile
-- after a window rolled over corrects the old window. KEYS[1..6] carry the tenant's hash
-- tag {t}; KEYS[7] is the owner's (see quota/keyspace.py).
--
-- KEYS[1] tokens-per-minute counter of the request's minute  sy:{t}:tpm:<minute>
-- KEYS[2] tokens-per-day counter of the request's day        sy:{t}:tpd:<day>
-- KEYS[3] concurrency sorted set                             sy:{t}:conc
-- KEYS[4] the reservation's pending marker                   sy:{t}:pending:<request id>
-- KEYS[5] the marker as a sweep left it                      sy:{t}:swept:<request id>
-- KEYS[6] done marker of an unchecked charge                 sy:{t}:charged:<request id>
-- KEYS[7] the owner's pending index                          sy:owner:{o}:pending
-- KEYS[8] usage of the request's hour                        sy:{t}:uh:<hour>
-- KEYS[9] usage of the request's day                         sy:{t}:ud:<day>
-- KEYS[10] the tenant's recent-request log                   sy:{t}:recent
-- KEYS[11] last use of each of the tenant's keys             sy:{t}:keyuse (key id -> unix s)
-- KEYS[12] money spent on the request's day                  sy:{t}:spend:d:<day>
-- KEYS[13] money spent in the request's month                sy:{t}:spend:m:<month>
-- ARGV[1] token delta: actual - reserved (may be negative); for "unchecked", actual
-- ARGV[2] "checked": a reservation made by reserve.lua. It acts if its pending marker exists
--           (and releases the slot) or, once its owner was swept as dead, if the swept
--           marker does (the slot is already free); either marker is deleted.
--         "unchecked": a request admitted while Redis was unreachable. It acts only if it can
--           create the done marker KEYS[6] (SET NX), so a replay after a lost reply or a
--           crash charges once. Should a pending (or swept) marker exist after all
--           (reserve.lua ran but its reply was lost), that reservation is settled instead
--           of charging twice.
-- ARGV[3] request id (the concurrency member to release)
-- ARGV[4] TTL of a minute counter created here, s
-- ARGV[5] TTL of a day counter created here, s
-- ARGV[6] TTL of the done marker, s
-- ARGV[7] index member "<tenant>|<request id>" to drop from KEYS[7] ("" = not indexed)
-- ARGV[8] usage record JSON (quota/usage.py `usage_record`), "" = none; written only when the
--         settlement acts, so a request's usage is recorded exactly once
-- ARGV[9] TTL of the hour usage hash, s;  ARGV[10] of the day hash, s
-- ARGV[11] most lines kept in the recent log
-- ARGV[12] money delta, nanos, as ARGV[1] is for tokens: actual - reserved (checked), actual
--          (unchecked: a reservation found after all is subtracted, as for tokens)
-- ARGV[13] TTL of a day's spend counter created here, s;  ARGV[14] of a month's
--
-- Returns 1 when applied, 0 when it was already settled (nothing done).
-- Counters are clamped at zero; a lowered counter that has already expired stays absent.

if ARGV[7] ~= '' then redis.call('ZREM', KEYS[7], ARGV[7]) end

local delta = tonumber(ARGV[1])
local cost_delta = tonumber(ARGV[12])

if ARGV[2] == 'checked' then
  if redis.call('DEL', KEYS[4]) == 1 then
    redis.call('ZREM', KEYS[3], ARGV[3])
  elseif redis.call('DEL', KEYS[5]) == 0 then
    return 0
  end
elseif ARGV[2] == 'unchecked' then
  if not redis.call('SET', KEYS[6], '1', 'NX', 'EX', ARGV[6]) then return 0 end
  local marker = KEYS[4]
  local reserved = redis.call('HMGET', marker, 'tokens', 'cost')
  if reserved[1] then
    redis.call('DEL', KEYS[4])
    redis.call('ZREM', KEYS[3], ARGV[3])
  else
    reserved = redis.call('HMGET', KEYS[5], 'tokens', 'cost')
    if reserved[1] then redis.call('DEL', KEYS[5]) end
  end
  if reserved[1] then
    delta = delta - tonumber(reserved[1])
    cost_delta = cost_delta - tonumber(reserved[2] or 0)
  end
else
  return redis.error_reply('reconcile.lua: unknown mode ' .. tostring(ARGV[2]))
end

local function adjust(key, d, ttl)
  if d < 0 then
    if redis.call('EXISTS', key) == 0 then return end
    local left = redis.call('INCRBY', key, d)
    if left < 0 then redis.call('INCRBY', key, -left) end
  elseif d > 0 then
    redis.call('INCRBY', key, d)
    if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ttl) end
  end
end

adjust(KEYS[1], delta, ARGV[4])
adjust(KEYS[2], delta, ARGV[5])
if cost_delta ~= 0 then
  adjust(KEYS[12], cost_delta, ARGV[13])
  adjust(KEYS[13], cost_delta, ARGV[14])
end

if ARGV[8] ~= '' then
  local u = cjson.decode(ARGV[8])
  local function add(model, field, n)
    if n == 0 then return end
    local f = model .. '|' .. u.key .. '|' .. field
    redis.call('HINCRBY', KEYS[8], f, n)
    redis.call('HINCRBY', KEYS[9], f, n)
  end
  add(u.model, 'n', 1)
  add(u.model, 'err', u.err)
  add(u.model, 'lat_ms', u.lat_ms)
  for _, p in ipairs(u.parts) do
    add(p[1], 'prompt', p[2])
    add(p[1], 'cached', p[3])
    add(p[1], 'completion', p[4])
    add(p[1], 'cost', p[5] or 0)
  end
  if u.auto then  -- an `auto` request: under who answered, what it cost and would have
    add(u.model, 'auto_n', 1)
    add(u.model, 'auto_cost', u.auto[1])
    add(u.model, 'auto_if_large', u.auto[2])
    add(u.model, 'auto_if_small', u.auto[3])
    add(u.model, 'auto_esc', u.auto[4])
    add(u.model, 'auto_over', u.auto[5])
  end
  redis.call('EXPIRE', KEYS[8], ARGV[9])
  redis.call('EXPIRE', KEYS[9], ARGV[10])
  redis.call('LPUSH', KEYS[10], u.line)
  redis.call('LTRIM', KEYS[10], 0, tonumber(ARGV[11]) - 1)
  redis.call('EXPIRE', KEYS[10], ARGV[10])
  if u.key ~= '-' then
    redis.call('HSET', KEYS[11], u.key, tostring(u.ts))
    redis.call('EXPIRE', KEYS[11], ARGV[10])
  end
end
return 1
