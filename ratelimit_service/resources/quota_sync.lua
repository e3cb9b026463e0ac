-- quota_sync.lua: RLQS usage of Envoy instances, per counter, shared by every replica.
--
-- Each counter is a hash: 'w' the current fixed window's index and 'u' the allowed
-- hits reported in it (windows aligned to the epoch); per instance, 'd:<name>' its
-- demand in requests per second ('-1': not measured yet) and 't:<name>' when it last
-- reported (microseconds). Instances silent longer than the forget time are removed.
--
-- KEYS      one hash per reported counter, in order
-- ARGV[1]   forget time in microseconds
-- ARGV[2 + 4*(i-1) ...] for counter i: instance name, demand ('-1' for none),
--           allowed hits, window in microseconds
-- Returns   per counter: {used in the window, instance count, then name, demand
--           (as a string, '-1' for none) per instance}, all flattened
-- Time comes from the Redis server (TIME), so service clocks may disagree freely.

local call, tonumber, format = redis.call, tonumber, string.format
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local forget = tonumber(ARGV[1])
local out = {}
for i, key in ipairs(KEYS) do
  local base = 2 + 4 * (i - 1)
  local name, demand = ARGV[base], ARGV[base + 1]
  local allowed, window = tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  call('HSET', key, 'd:' .. name, demand, 't:' .. name, format('%d', now))
  local index = format('%d', math.floor(now / window))
  local fields = call('HGETALL', key)
  local used, stored_window = 0, nil
  local seen, demands, stale = {}, {}, {}
  for j = 1, #fields, 2 do
    local field, value = fields[j], fields[j + 1]
    local kind, who = string.sub(field, 1, 2), string.sub(field, 3)
    if field == 'w' then stored_window = value
    elseif field == 'u' then used = tonumber(value)
    elseif kind == 't:' then seen[who] = tonumber(value)
    elseif kind == 'd:' then demands[who] = value
    end
  end
  if stored_window ~= index then used = 0 end
  used = used + allowed
  call('HSET', key, 'w', index, 'u', format('%d', used))
  local live = {}
  for who, at in pairs(seen) do
    if now - at > forget then
      stale[#stale + 1] = 'd:' .. who
      stale[#stale + 1] = 't:' .. who
    else
      live[#live + 1] = who
    end
  end
  if #stale > 0 then call('HDEL', key, unpack(stale)) end
  local keep = window
  if forget > keep then keep = forget end
  call('PEXPIRE', key, format('%d', math.ceil(keep * 2 / 1000)))
  out[#out + 1] = used
  out[#out + 1] = #live
  for _, who in ipairs(live) do
    out[#out + 1] = who
    out[#out + 1] = demands[who] or '-1'
  end
end
return out
