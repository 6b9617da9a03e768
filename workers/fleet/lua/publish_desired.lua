-- publish_desired.lua: the leader's desired replicas per pool, for every gateway's
-- /metrics (switchyard_autoscaler_desired_replicas), fenced like an order.
--
-- KEYS[1]  the token counter   sy:{fleet}:token
-- KEYS[2]  desired replicas    sy:{fleet}:desired   (hash: pool -> count)
-- ARGV[1]  the leader's token
-- ARGV[2..] pool, count, pool, count, ...
-- Returns 1 when written, 0 when the token is stale (nothing written).
local highest = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) < highest then
  return 0
end
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
return 1
