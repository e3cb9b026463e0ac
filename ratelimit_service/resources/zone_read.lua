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
for _, hash in ipairs(keys) do
  local f = call('HMGET', hash, 'K', 'D', 'N', 'R', 'W', 'w', 'u', 'gw', 'g')
  local window, limit = tonumber(f[5]), tonumber(f[4])
  if f[1] and window and limit then
    local index = math.floor(now / window)
    local text = format('%d', index)
    local used, forwarded = 0, 0
    if f[6] == text then used = tonumber(f[7]) or 0 end
    if f[8] == text then forwarded = tonumber(f[9]) or 0 end
    out[#out + 1] = hash
    out[#out + 1] = f[1]
    out[#out + 1] = math.max(tonumber(f[2]) or 0, 0)
    out[#out + 1] = math.max(tonumber(f[3]) or 0, 0)
    out[#out + 1] = limit
    out[#out + 1] = window
    out[#out + 1] = used
    out[#out + 1] = forwarded
    out[#out + 1] = index
  end
end
return out
