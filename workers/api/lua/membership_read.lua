-- membership_read.lua: one pool's live members, pruning those whose deadline has passed.
-- See workers/api/membership.py for the layout.
--
-- KEYS[1] the pool's members: sorted set, member id -> deadline (ms)   sy:{fleet}:members:<pool>
-- KEYS[2] the pool's records: hash, member id -> record JSON           sy:{fleet}:records:<pool>
-- KEYS[3] the pool's model: hash {fingerprint, deadline_ms}            sy:{fleet}:model:<pool>
-- ARGV[1] now in ms; "": the Redis server's clock (tests give theirs)
-- Returns {now ms, the pool's model fingerprint or "", then per live member: its id, its
-- deadline (ms), its record JSON}. Reading twice is harmless.

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, id in ipairs(expired) do
  redis.call('HDEL', KEYS[2], id)
end
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
end

local model = redis.call('HMGET', KEYS[3], 'fingerprint', 'deadline_ms')
local fingerprint = ''
if model[1] and model[2] and tonumber(model[2]) > now then
  fingerprint = model[1]
end

local out = {now, fingerprint}
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES')
for i = 1, #live, 2 do
  local record = redis.call('HGET', KEYS[2], live[i])
  if record then
    out[#out + 1] = live[i]
    out[#out + 1] = live[i + 1]
    out[#out + 1] = record
  end
end
return out
