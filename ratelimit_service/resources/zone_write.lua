-- zone_write.lua: the zone aggregator writes back what the global store answered for
-- each counter (storage/zoned.py; the fields quota_tier.lua reads in a zone).
--
-- KEYS      the counters' hashes in the zone store
-- ARGV[4*(i-1) + 1 ...] for counter i: the zone's part of the limit ('Z', thousandths
--           of a hit per second), the fleet's allowed hits ('G') in window 'gw', of
--           which 'g' came from this zone
-- Returns   how many counters were written (a hash that has expired meanwhile is not
--           written again: it would have no expiry)

local call = redis.call
local written = 0
for i, hash in ipairs(KEYS) do
  if call('EXISTS', hash) == 1 then
    local base = 4 * (i - 1)
    call('HSET', hash, 'Z', ARGV[base + 1], 'G', ARGV[base + 2], 'gw', ARGV[base + 3],
      'g', ARGV[base + 4])
    written = written + 1
  end
end
return written
