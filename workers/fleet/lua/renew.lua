-- renew.lua: extend the leader lease, only for the holder of this very token.
--
-- KEYS[1]  the lease          sy:{fleet}:leader
-- ARGV[1]  "<holder id>|<token>"
-- ARGV[2]  ttl, ms
-- Returns 1 when renewed, 0 when the lease is gone or another's (the caller is no longer
-- leader). Safe to send again.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
