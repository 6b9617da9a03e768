-- reconcile.lua: settle a reservation to the tokens actually used, once.
-- KEYS are the windows the reservation was charged to, never the current ones, so a
-- reconcile after a window rolled over corrects the old window.
--
-- KEYS[1] tokens-per-minute counter of the reservation's minute  sy:{t}:tpm:<minute>
-- KEYS[2] tokens-per-day counter of the reservation's day        sy:{t}:tpd:<day>
-- KEYS[3] concurrency sorted set                                 sy:{t}:conc
-- KEYS[4] the reservation's pending marker                       sy:{t}:pending:<request id>
-- ARGV[1] token delta: actual - reserved (may be negative)
-- ARGV[2] "1": act only if the pending marker exists, and delete it (idempotence);
--         "0": act regardless (a reservation made while Redis was down has no marker)
-- ARGV[3] request id (the concurrency member to release)
-- ARGV[4] TTL of a minute counter created here, s
-- ARGV[5] TTL of a day counter created here, s
--
-- Returns 1 when applied, 0 when the reservation was already reconciled (nothing done).
-- Counters are clamped at zero; a lowered counter that has already expired stays absent.

if ARGV[2] == '1' and redis.call('DEL', KEYS[4]) == 0 then
  return 0
end

local delta = tonumber(ARGV[1])

local function adjust(key, ttl)
  if delta < 0 then
    if redis.call('EXISTS', key) == 0 then return end
    local left = redis.call('INCRBY', key, ARGV[1])
    if left < 0 then redis.call('INCRBY', key, -left) end
  elseif delta > 0 then
    redis.call('INCRBY', key, ARGV[1])
    if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ttl) end
  end
end

adjust(KEYS[1], ARGV[4])
adjust(KEYS[2], ARGV[5])
redis.call('ZREM', KEYS[3], ARGV[3])
return 1
