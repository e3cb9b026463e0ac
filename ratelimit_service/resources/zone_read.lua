-- zone_read.lua: the zone aggregator's read of its zone store
-- (engine/zone_aggregator.py): every counter a replica of the zone published lately,
-- with the zone's sums (held to what quota_tier.lua kept by tests/core/test_tiers.py).
--
-- KEYS[1]   the zone's index of counters (a sorted set of counter hashes, scored by
--           their last publish in microseconds; written by quota_tier.lua)
-- ARGV[1]   forget time in microseconds: older entries leave the index
-- ARGV[2]   the most counters to return (the oldest first)
-- Returns   per counter: {hash key, counter key, demand (thousandths of a hit per
--           second), instances, limit (thousandths), window (microseconds), the
--           zone's allowed hits in the current window, of those what was already
--           forwarded to the global store, the current window's index}, flattened;
--           a hash that has expired, or has no limit field,
--           is left out: the zone keeps its last part of it
-- Time comes from the Redis server (TIME), as in quota_tier.lua.

local call, tonumber, format = redis.call, tonumber, string.format
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local since = now - tonumber(ARGV[1])
call('ZREMRANGEBYSCORE', KEYS[1], '-inf', format('(%d', since))
local keys = call('ZRANGEBYSCORE', KEYS[1], format('%d', since), '+inf', 'LIMIT', '0', ARGV[2])
local out = {}
local unpack_state = struct.unpack
for _, hash in ipairs(keys) do
  local f = call('HMGET', hash, 'K', 'v', 'R', 'W', 'gw', 'g')
  local window, limit = tonumber(f[4]), tonumber(f[3])
  if f[1] and window and limit then
    local demand, instances, window_at, used_then
    if f[2] then
      -- quota_tier.lua's packed state: the sums, parts, window index and its hits, ...
      local d, n, _, w, u = unpack_state('<ddddddddd', f[2])
      demand, instances, window_at, used_then = d, n, w, u
    else
      -- the earlier layout, a field per figure, until its next publish moves them
      local old = call('HMGET', hash, 'D', 'N', 'w', 'u')
      demand, instances = tonumber(old[1]) or 0, tonumber(old[2]) or 0
      window_at, used_then = tonumber(old[3]), tonumber(old[4]) or 0
    end
    local index = math.floor(now / window)
    local used, forwarded = 0, 0
    if window_at == index then used = used_then end
    if tonumber(f[5]) == index then forwarded = tonumber(f[6]) or 0 end
    out[#out + 1] = hash
    out[#out + 1] = f[1]
    out[#out + 1] = math.max(demand, 0)
    out[#out + 1] = math.max(instances, 0)
    out[#out + 1] = limit
    out[#out + 1] = window
    out[#out + 1] = used
    out[#out + 1] = forwarded
    out[#out + 1] = index
  end
end
return out
