-- read_hosts.lua: every live host's record, and the server's clock.
--
-- KEYS[1]  the hosts' index    sy:{fleet}:hosts   (zset: host id -> expiry ms)
-- ARGV[1]  the record keys' prefix, "sy:{fleet}:host:" (same hash tag: same slot)
-- Returns {server ms, host id, body, at_ms, host id, body, at_ms, ...}; lapsed hosts are
-- dropped from the index on the way.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
local out = {now_ms}
for _, host in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local rec = redis.call('HMGET', ARGV[1] .. host, 'body', 'at_ms')
  if rec[1] then
    out[#out + 1] = host
    out[#out + 1] = rec[1]
    out[#out + 1] = rec[2]
  end
end
return out
