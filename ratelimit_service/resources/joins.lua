-- joins.lua: how many times a member has been new to an RLQS counter in this store.
-- Twin: storage/embedded.py EmbeddedStore.joins; decoded by storage/script_calls.py
-- joins_reply.
--
-- A member new to a counter gets at least its even share by instances at once
-- (quota_tier.lua), which the other members' parts leave only when they publish again.
-- A member whose publishes wait (core/stretch.py steady_over) reads this count each
-- round, and publishes every counter in a round where it moved: the newcomer's share
-- is then held over the limit for a round, not for as many rounds as a publish waits.
-- A member adds one after its first publish of a counter (engine/quota.py).
--
-- KEYS[1]   the count (a string key, no expiry: a few bytes per store)
-- ARGV[1]   '1': add one first; '': read only
-- Returns   the count (0 before the first join)

if ARGV[1] == '1' then
  return redis.call('INCR', KEYS[1])
end
return tonumber(redis.call('GET', KEYS[1]) or '0')
