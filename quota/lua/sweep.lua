-- sweep.lua: settle one reservation whose owner (gateway) died before reconciling it.
-- The slot is released at once; the reserved tokens stay charged (all the dead gateway could
-- have used). The marker moves to KEYS[2] so that, should the owner be alive after all (a
-- long pause), its late reconcile still applies actual - reserved, once (reconcile.lua).
-- Several sweepers may race on one reservation: only one finds the pending marker.
--
-- KEYS[1] the reservation's pending marker   sy:{t}:pending:<request id>
-- KEYS[2] where the marker moves             sy:{t}:swept:<request id>
-- KEYS[3] concurrency sorted set             sy:{t}:conc
-- KEYS[4] the dead owner's pending index     sy:owner:{o}:pending
-- ARGV[1] request id (the concurrency member to release)
-- ARGV[2] index member "<tenant>|<request id>"
-- ARGV[3] the dead owner's id: a marker of another owner is left alone
-- ARGV[4] TTL of the swept marker, s
--
-- Returns 1 when swept, 0 when nothing was pending for that owner (already reconciled or
-- swept); either way the index member is gone.

redis.call('ZREM', KEYS[4], ARGV[2])
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[3] then return 0 end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
