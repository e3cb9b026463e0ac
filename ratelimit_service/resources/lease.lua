-- lease.lua: take or renew a lease (the zone aggregator's, storage/zoned.py).
--
-- KEYS[1]   the lease key
-- ARGV[1]   who asks
-- ARGV[2]   time to live in milliseconds
-- Returns   {2: taken now, 1: renewed (it already held it), 0: held by another;
--           then the holder's name}

local call = redis.call
local holder = call('GET', KEYS[1])
if holder == ARGV[1] then
  call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, holder}
end
if not holder then
  call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {2, ARGV[1]}
end
return {0, holder}
