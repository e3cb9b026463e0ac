-- joins.lua: how many times a member has been new to an RLQS counter in this store, per
-- slot of counters (core/stretch.py join_slot, JOIN_SLOTS). Twin: storage/embedded.py
-- EmbeddedStore.joins; decoded by storage/script_calls.py joins_reply.
--
-- A member new to a counter gets at least its even share by instances at once
-- (quota_tier.lua), which the other members' parts leave only when they publish again.
-- A member whose publishes wait (core/stretch.py steady_over) reads these counts each
-- round, and publishes the counters of the slots that moved: the newcomer's share is
-- then held over the limit for a round or two, not for as many rounds as a publish
-- waits. A member adds one to a counter's slot the round after its first publish of it
-- (engine/quota.py, engine/zone_aggregator.py), in the same call as its read.
--
-- KEYS[1]   the counts (a hash: field the slot, value its count; no expiry: a few
--           hundred bytes per store)
-- ARGV[1]   the number of slots
-- ARGV[2..] slots to add one to first (none: read only)
-- Returns   every slot's count, in slot order (0 before its first join)

local call = redis.call
for i = 2, #ARGV do
  call('HINCRBY', KEYS[1], ARGV[i], 1)
end
local fields = {}
for slot = 0, tonumber(ARGV[1]) - 1 do
  fields[#fields + 1] = tostring(slot)
end
local counts = call('HMGET', KEYS[1], unpack(fields))
for i = 1, #counts do
  counts[i] = tonumber(counts[i] or '0')
end
return counts
