-- zone_write.lua: the zone aggregator writes back what the global store answered for
-- each counter (storage/zoned.py; the fields quota_tier.lua and fleet_sync.lua read
-- in a zone), and how many zones share the fleet.
--
-- KEYS[1]   the zone's count of zones (fleet_sync.lua divides a bucket's limit by it
--           until the bucket's own part comes back)
-- KEYS[2..] the counters' hashes in the zone store
-- ARGV[1]   the number of zones ('' to leave the count as it is)
-- ARGV[2]   how long the count lives, in milliseconds
-- ARGV[3 + 4*(i-1) ...] for counter i: the zone's part of the limit ('Z', thousandths
--           of a hit per second), the fleet's allowed hits ('G') in window 'gw', of
--           which 'g' came from this zone
-- Returns   how many counters were written (a hash that has expired meanwhile is not
--           written again: it would have no expiry)

local call = redis.call
if ARGV[1] ~= '' then call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
local written = 0
for i = 2, #KEYS do
  local hash = KEYS[i]
  if call('EXISTS', hash) == 1 then
    local base = 3 + 4 * (i - 2)
    call('HSET', hash, 'Z', ARGV[base], 'G', ARGV[base + 1], 'gw', ARGV[base + 2],
      'g', ARGV[base + 3])
    written = written + 1
  end
end
return written
