-- acquire.lua: take the leader lease if nobody holds it, with a new fencing token.
--
-- KEYS[1]  the lease          sy:{fleet}:leader   (value "<holder id>|<token>", expiry ttl)
-- KEYS[2]  the token counter  sy:{fleet}:token    (INCR'd at each take, never reset)
-- ARGV[1]  holder id
-- ARGV[2]  ttl, ms
-- Returns {token, server ms, 0} when taken; {0, server ms, remaining ms of the holder's
-- lease} when another holds it. Sent twice after a lost reply, the second finds the
-- first's lease and reports it held (the holder then waits it out, or it is renewed by
-- nobody and expires): never two tokens live at once.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local remaining = redis.call('PTTL', KEYS[1])
if remaining ~= -2 then
  return {0, now_ms, remaining}
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'NX', 'PX', ARGV[2])
return {token, now_ms, 0}
