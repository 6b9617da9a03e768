-- release.lua: give the leader lease up (a clean shutdown), so a contender takes it at
-- once instead of after its ttl.
--
-- KEYS[1]  the lease          sy:{fleet}:leader
-- ARGV[1]  "<holder id>|<token>"
-- Returns 1 when released, 0 when it was not held so. Safe to send again.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
