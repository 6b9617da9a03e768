-- acquire.lua: take the leader lease if nobody holds it, with a new fencing token.
--
-- KEYS[1]  the lease          sy:{fleet}:leader   (value "<holder id>|<token>", expiry ttl)
-- KEYS[2]  the token counter  sy:{fleet}:token    (INCR'd at each take, never reset)
-- ARGV[1]  holder id (unique per process: "<host>:<pid>:<nonce>")
-- ARGV[2]  ttl, ms
-- Returns {token, server ms, 0} when taken; {0, server ms, remaining ms of the holder's
-- lease} when another holds it. Sent again after a lost reply, it finds the lease its
-- own and returns the same token with a fresh expiry: never two tokens live at once.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local current = redis.call('GET', KEYS[1])
if current then
  local sep = string.find(current, '|', 1, true)
  if sep and string.sub(current, 1, sep - 1) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {tonumber(string.sub(current, sep + 1)), now_ms, 0}
  end
  return {0, now_ms, redis.call('PTTL', KEYS[1])}
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return {token, now_ms, 0}
