-- zone_write.lua: the zone aggregator writes back what the global store answered for
-- each counter (engine/zone_aggregator.py; the fields quota_tier.lua and fleet_sync.lua
-- read in a zone), and how many zones share the fleet; refused for a fencing token
-- lower than the zone's counter. Held to what the other scripts then read by
-- tests/storage/test_fleet_sync_script.py and tests/core/test_tiers.py, its fence by
-- tests/core/test_zones.py.
--
-- KEYS[1]   the zone's count of zones (fleet_sync.lua divides a bucket's limit by it
--           until the bucket's own part comes back)
-- KEYS[2]   the zone's fencing counter (lease.lua hands out its tokens): a write with a
--           lower token is refused (a deposed aggregator's late write), a higher one
--           raises it
-- KEYS[3..] the counters' hashes in the zone store
-- ARGV[1]   the number of zones ('' to leave the count as it is)
-- ARGV[2]   how long the count lives, in milliseconds
-- ARGV[3]   the writer's fencing token
-- ARGV[4 + 5*(i-1) ...] for counter i: the zone's part of the limit ('Z', thousandths
--           of a hit per second), the fleet's allowed hits ('G') in window 'gw', of
--           which 'g' came from this zone; for a calendar budget's bucket, the
--           admitted total the zone may reach ('T', fleet_sync.lua; '' for any other)
-- Returns   how many counters were written (a hash that has expired meanwhile is not
--           written again: it would have no expiry); or, refused, {-1, the counter}

local call, tonumber = redis.call, tonumber
local token = tonumber(ARGV[3])
local highest = tonumber(call('GET', KEYS[2]) or '0')
if token < highest then return {-1, highest} end
if token > highest then call('SET', KEYS[2], ARGV[3]) end
if ARGV[1] ~= '' then call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
local written = 0
for i = 3, #KEYS do
  local hash = KEYS[i]
  if call('EXISTS', hash) == 1 then
    local base = 4 + 5 * (i - 3)
    call('HSET', hash, 'Z', ARGV[base], 'G', ARGV[base + 1], 'gw', ARGV[base + 2],
      'g', ARGV[base + 3])
    if ARGV[base + 4] ~= '' then call('HSET', hash, 'T', ARGV[base + 4]) end
    written = written + 1
  end
end
return written
