-- give_orders.lua: append a leader's orders to their hosts' queues, all or none, only if
-- the leader's fencing token is the newest handed out (a stale leader's orders are
-- refused: its token is below the highest, which is at least any token ever accepted).
--
-- KEYS[1]  the token counter       sy:{fleet}:token
-- KEYS[2]  the order sequence      sy:{fleet}:order_seq
-- KEYS[3..] each order's host queue sy:{fleet}:orders:<host id>   (a list)
-- ARGV[1]  the leader's token
-- ARGV[2]  the queues' expiry, ms (orders to a host that stopped taking them lapse)
-- ARGV[3..] each order's body (JSON), in KEYS' order
-- Returns {1, seq of each order...} when given; {0, highest token} when refused.
-- Each queue entry is "<token>|<seq>|<body>".
local highest = tonumber(redis.call('GET', KEYS[1]) or '0')
local token = tonumber(ARGV[1])
if token < highest then
  return {0, highest}
end
local out = {1}
for i = 3, #KEYS do
  local seq = redis.call('INCR', KEYS[2])
  redis.call('RPUSH', KEYS[i], ARGV[1] .. '|' .. seq .. '|' .. ARGV[i])
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
  out[#out + 1] = seq
end
return out
