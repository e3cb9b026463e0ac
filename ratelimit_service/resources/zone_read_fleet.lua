-- zone_read_fleet.lua: the zone aggregator's read of its zone store's probabilistic
-- buckets (engine/zone_aggregator.py): every bucket a replica of the zone synced
-- lately (held to what fleet_sync.lua kept by tests/storage/test_fleet_sync_script.py;
-- the offered and admitted counts from its packed state, 'v').
--
-- KEYS[1]   the zone's index of buckets (a sorted set of bucket hashes, scored by
--           their last sync in microseconds; written by fleet_sync.lua)
-- KEYS[2]   the zone's node registry (fleet_sync.lua's): the live replicas
-- ARGV[1]   forget time in microseconds: older entries leave the index
-- ARGV[2]   the most buckets to return (the oldest first)
-- Returns   {now in microseconds, live replicas, then per bucket: hash key, bucket
--           key, offered total, admitted total, limit per window, window
--           (microseconds), admitted hits already forwarded to the global store, when
--           the bucket was created (microseconds), a calendar budget's period end
--           (microseconds; 0 for a rolling bucket)} flattened; a hash that has expired
--           is left out
-- Time comes from the Redis server (TIME), as in fleet_sync.lua.

local call, tonumber, format = redis.call, tonumber, string.format
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local since = now - tonumber(ARGV[1])
call('ZREMRANGEBYSCORE', KEYS[1], '-inf', format('(%d', since))
local keys = call('ZRANGEBYSCORE', KEYS[1], format('%d', since), '+inf', 'LIMIT', '0', ARGV[2])
local out = {now, call('ZCARD', KEYS[2])}
local unpack_state = struct.unpack
for _, hash in ipairs(keys) do
  local f = call('HMGET', hash, 'K', 'v', 'L', 'W', 'g', 'c', 'E')
  if f[1] and f[4] then
    local offered, admitted = 0, 0
    if f[2] then
      -- fleet_sync.lua's packed state: tokens, stamp, offered, admitted, ...
      local _, _, o, a = unpack_state('<dddddddd', f[2])
      offered, admitted = o, a
    else
      -- the earlier layout, a field per figure, until its next sync moves them
      local old = call('HMGET', hash, 'o', 'a')
      offered, admitted = tonumber(old[1]) or 0, tonumber(old[2]) or 0
    end
    out[#out + 1] = hash
    out[#out + 1] = f[1]
    out[#out + 1] = offered
    out[#out + 1] = admitted
    out[#out + 1] = tonumber(f[3]) or 0
    out[#out + 1] = tonumber(f[4])
    out[#out + 1] = tonumber(f[5]) or 0
    out[#out + 1] = tonumber(f[6]) or now
    out[#out + 1] = tonumber(f[7]) or 0
  end
end
return out
