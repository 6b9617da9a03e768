-- write_host.lua: a host's inventory record, stamped with the Redis server's clock, with
-- an expiry (a host that stops writing leaves the fleet when it lapses).
--
-- KEYS[1]  the host's record   sy:{fleet}:host:<host id>   (hash: body, at_ms)
-- KEYS[2]  the hosts' index    sy:{fleet}:hosts            (zset: host id -> expiry ms)
-- ARGV[1]  host id
-- ARGV[2]  the record (JSON)
-- ARGV[3]  ttl, ms
-- Returns the server time it was written at, ms. Safe to send again.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'body', ARGV[2], 'at_ms', now_ms)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), ARGV[1])
return now_ms
