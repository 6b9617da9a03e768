-- membership_announce.lua: announce (or re-announce, a heartbeat) one pool member, or leave
-- its tombstone (a withdrawal). See workers/api/membership.py for the layout.
--
-- KEYS[1] the pool's members: sorted set, member id -> deadline (ms)   sy:{fleet}:members:<pool>
-- KEYS[2] the pool's records: hash, member id -> record JSON           sy:{fleet}:records:<pool>
-- KEYS[3] the pool's model: hash {fingerprint, deadline_ms}            sy:{fleet}:model:<pool>
-- ARGV[1] member id
-- ARGV[2] the member's record (JSON)
-- ARGV[3] TTL, ms: the member's deadline is now + TTL
-- ARGV[4] the member's model fingerprint
-- ARGV[5] "1": publish a change (its state changed); a new member is always published
-- ARGV[6] the channel to publish on; ARGV[7] the message (the pool's name)
-- ARGV[8] now in ms; "": the Redis server's clock (tests give theirs)
-- ARGV[9] "1": a withdrawal; the record is a tombstone and does not hold the pool's model
-- Returns {now ms, 1 if the member's fingerprint is the pool's model else 0, the model}.
-- Safe to send again: a repeat rewrites the same record with a later deadline.

local now
if ARGV[8] ~= '' then
  now = tonumber(ARGV[8])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local ttl = tonumber(ARGV[3])

local previous = redis.call('ZSCORE', KEYS[1], ARGV[1])
local is_new = (not previous) or tonumber(previous) <= now

local model = redis.call('HMGET', KEYS[3], 'fingerprint', 'deadline_ms')
local fingerprint = model[1]
if fingerprint and (not model[2] or tonumber(model[2]) <= now) then
  fingerprint = false  -- no member has held it for a TTL: the next one sets it
end
local matches = 0
if ARGV[9] ~= '1' then
  if not fingerprint then
    fingerprint = ARGV[4]
    redis.call('HSET', KEYS[3], 'fingerprint', fingerprint, 'deadline_ms', now + ttl)
  end
  if fingerprint == ARGV[4] then
    matches = 1
    if tonumber(redis.call('HGET', KEYS[3], 'deadline_ms')) < now + ttl then
      redis.call('HSET', KEYS[3], 'deadline_ms', now + ttl)
    end
  end
elseif fingerprint == ARGV[4] then
  matches = 1
end

redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
-- Left alone, the keys of a pool whose members all died go away by themselves.
for i = 1, 3 do
  if redis.call('PTTL', KEYS[i]) < 2 * ttl then
    redis.call('PEXPIRE', KEYS[i], 2 * ttl)
  end
end
if is_new or ARGV[5] == '1' then
  redis.call('PUBLISH', ARGV[6], ARGV[7])
end
return {now, matches, fingerprint or ''}
