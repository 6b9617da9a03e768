-- take_orders.lua: a host takes every order queued for it, with the highest token handed
-- out at this instant (the host refuses an order whose token is below it: its leader was
-- replaced after writing it, and the new one decides from what the host reports now).
--
-- KEYS[1]  the token counter  sy:{fleet}:token
-- KEYS[2]  the host's queue   sy:{fleet}:orders:<host id>
-- Returns {highest token, entry...}, entries "<token>|<seq>|<body>" oldest first. Taken
-- once: a reply lost on the way loses those orders, and the leader, whose orders stay
-- in flight until the host's record shows their seq, sees them gone when the record
-- moves past it and decides again.
local highest = tonumber(redis.call('GET', KEYS[1]) or '0')
local entries = redis.call('LRANGE', KEYS[2], 0, -1)
redis.call('DEL', KEYS[2])
local out = {highest}
for i = 1, #entries do
  out[#out + 1] = entries[i]
end
return out
