-- lease.lua: take or renew a zone's aggregator lease, and hand out fencing tokens
-- (engine/zone_aggregator.py). Held to its model by tests/core/test_zones.py.
--
-- The lease is a hash: 'h' the holder, 't' its fencing token, 'e' when it expires
-- (microseconds, the server's clock). The fencing counter is the last token handed out
-- (or a higher one a write brought, zone_write.lua); it never expires, so a token is
-- never handed out twice while the store keeps its data.
--
-- KEYS[1]   the lease
-- KEYS[2]   the zone's fencing counter
-- ARGV[1]   who asks
-- ARGV[2]   time to live in microseconds
-- ARGV[3]   a token a write of the asker was refused against, or '': a holder whose
--           token is not above it gets a new one above it and the counter (its zone
--           store lost the counter), anyone else's ask is unchanged
-- Returns   {state, holder, the holder's token}; state TAKEN: taken now (it was free
--           or expired; a new token), RENEWED: the asker held it, HELD_BY_ANOTHER
--           (the numbers of core/zones.py LeaseState, which decodes them)
-- Time comes from the Redis server (TIME), so service clocks may disagree freely.

local call, tonumber, format = redis.call, tonumber, string.format
local HELD_BY_ANOTHER, RENEWED, TAKEN = 0, 1, 2
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local me, ttl, floor = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local lease = call('HMGET', KEYS[1], 'h', 't', 'e')
local highest = tonumber(call('GET', KEYS[2]) or '0')
local state, token
if lease[1] and tonumber(lease[3]) > now then
  token = tonumber(lease[2])
  if lease[1] ~= me then return {HELD_BY_ANOTHER, lease[1], token} end
  state = RENEWED
  if floor and floor >= token then
    highest = math.max(highest, floor) + 1
    token = highest
    call('SET', KEYS[2], format('%d', highest))
  end
else
  state = TAKEN
  highest = math.max(highest, floor or 0) + 1
  token = highest
  call('SET', KEYS[2], format('%d', highest))
end
call('HSET', KEYS[1], 'h', me, 't', format('%d', token), 'e', format('%d', now + ttl))
-- Kept past its expiry for a while (the time above decides; this only frees memory).
call('PEXPIRE', KEYS[1], format('%d', math.ceil(ttl / 1000) * 2 + 60000))
return {state, me, token}
