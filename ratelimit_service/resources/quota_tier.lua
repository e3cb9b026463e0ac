-- quota_tier.lua: one member's (a replica's) RLQS totals per counter, and the fleet's.
--
-- Each counter is a hash and a sorted set that share a hash tag (one Cluster slot).
-- The hash: 'D' the sum of the live members' demands (thousandths of a hit per
-- second), 'N' the sum of their instances, 'w' the current fixed window's index and
-- 'u' the hits allowed in it (windows aligned to the epoch); per member 'd:<name>' and
-- 'n:<name>' its last demand and instance count. The sorted set scores each member
-- by when it last published (microseconds). Members silent longer than the forget
-- time leave the sums, at most 16 per call (oldest first), so the work per call does
-- not grow with the fleet. Arithmetic twin: core/tiers.py TierTable.publish.
--
-- KEYS      per counter: its hash, then its sorted set
-- ARGV[1]   this member's name
-- ARGV[2]   forget time in microseconds
-- ARGV[3 + 4*(i-1) ...] for counter i: demand (integer thousandths of a hit per
--           second), instances, allowed hits since the last publish, window in
--           microseconds
-- Returns   per counter: {fleet demand (thousandths), fleet instances, live
--           members, allowed hits in the window}, flattened
-- Time comes from the Redis server (TIME), so service clocks may disagree freely.

local call, tonumber, format = redis.call, tonumber, string.format
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local me, forget = ARGV[1], tonumber(ARGV[2])
local out = {}
for i = 1, #KEYS / 2 do
  local hash, members = KEYS[2 * i - 1], KEYS[2 * i]
  local base = 3 + 4 * (i - 1)
  local demand, instances = tonumber(ARGV[base]), tonumber(ARGV[base + 1])
  local allowed, window = tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local stale = call('ZRANGEBYSCORE', members, '-inf', format('(%d', now - forget),
    'LIMIT', '0', '16')
  for _, who in ipairs(stale) do
    local gone = call('HMGET', hash, 'd:' .. who, 'n:' .. who)
    call('HINCRBY', hash, 'D', format('%d', -(tonumber(gone[1]) or 0)))
    call('HINCRBY', hash, 'N', format('%d', -(tonumber(gone[2]) or 0)))
    call('HDEL', hash, 'd:' .. who, 'n:' .. who)
    call('ZREM', members, who)
  end
  local old = call('HMGET', hash, 'd:' .. me, 'n:' .. me)
  local total_demand = call('HINCRBY', hash, 'D',
    format('%d', demand - (tonumber(old[1]) or 0)))
  local total_instances = call('HINCRBY', hash, 'N',
    format('%d', instances - (tonumber(old[2]) or 0)))
  call('HSET', hash, 'd:' .. me, format('%d', demand), 'n:' .. me, format('%d', instances))
  call('ZADD', members, format('%d', now), me)
  local index = format('%d', math.floor(now / window))
  local state = call('HMGET', hash, 'w', 'u')
  local used = 0
  if state[1] == index then used = tonumber(state[2]) or 0 end
  used = used + allowed
  call('HSET', hash, 'w', index, 'u', format('%d', used))
  local keep = window
  if forget > keep then keep = forget end
  local keep_ms = format('%d', math.ceil(keep * 2 / 1000))
  call('PEXPIRE', hash, keep_ms)
  call('PEXPIRE', members, keep_ms)
  if total_demand < 0 then total_demand = 0 end
  if total_instances < 0 then total_instances = 0 end
  out[#out + 1] = total_demand
  out[#out + 1] = total_instances
  out[#out + 1] = call('ZCARD', members)
  out[#out + 1] = used
end
return out
