-- exact_window.lua: exact sliding-window decision for all exact descriptors of one request.
--
-- Same arithmetic as ratelimit_service/core/window.py and core/exact.py: a window of
-- T microseconds is cut into S slices; a key is a hash {slice index -> hits}; the
-- window at `now` holds slices cur-S .. cur (cur = floor(now / (T/S))). Every hit is
-- checked first; the request is denied if an enforcing descriptor does not fit, or if
-- every quota descriptor does not fit; only an admitted request consumes.
--
-- KEYS[i]  window hash of descriptor i
-- ARGV[1]  1 = consume if admitted, 0 = check only
-- ARGV[2]  S, slices per window
-- ARGV[3 + 4*(i-1) ...] for descriptor i: limit, window_us, hits, role
--          (role 0 = enforce, 1 = shadow: never denies, 2 = quota)
-- Returns  a flat array, 4 integers per descriptor:
--          admitted (1/0), hits in the window before, remaining after, reset_after_us
--          (admitted: until the oldest slice leaves; denied: until the hits would fit)
-- Time comes from the Redis server (TIME), so service clocks may disagree freely.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local commit = ARGV[1] == '1'
local slices = tonumber(ARGV[2])
local n = #KEYS

-- One pass per key: the live total and the oldest live slice; expired slices are
-- deleted. The live slices are kept (unsorted) only for the rare denied answer.
local state = {}
for i = 1, n do
  local base = 3 + 4 * (i - 1)
  local limit = tonumber(ARGV[base])
  local window = tonumber(ARGV[base + 1])
  local width = window / slices
  local cur = math.floor(now / width)
  local oldest = cur - slices
  local raw = redis.call('HGETALL', KEYS[i])
  local stale, total, first, live = {}, 0, nil, raw
  for j = 1, #raw, 2 do
    local index = tonumber(raw[j])
    if index < oldest then
      stale[#stale + 1] = raw[j]
    else
      total = total + tonumber(raw[j + 1])
      if first == nil or index < first then first = index end
    end
  end
  if #stale > 0 then redis.call('HDEL', KEYS[i], unpack(stale)) end
  local hits = tonumber(ARGV[base + 2])
  local need = hits
  if need < 1 then need = 1 end
  state[i] = {limit = limit, window = window, width = width, cur = cur, oldest = oldest,
              raw = live, first = first, total = total, hits = hits,
              role = tonumber(ARGV[base + 3]), ok = total + need <= limit}
end

local denied = false
local quota_seen, quota_all_over = false, true
for i = 1, n do
  local s = state[i]
  if s.role == 0 and not s.ok then denied = true end
  if s.role == 2 then
    quota_seen = true
    if s.ok then quota_all_over = false end
  end
end
if quota_seen and quota_all_over then denied = true end

local function leave_after(s, index)
  local at = (index + slices + 1) * s.width - now
  if at < 0 then return 0 end
  return math.floor(at)
end

-- Seconds (in microseconds) until a denied request's hits would fit: walk the live
-- slices oldest first until enough hits have left the window.
local function wait_for_room(s)
  local live = {}
  for j = 1, #s.raw, 2 do
    local index = tonumber(s.raw[j])
    if index >= s.oldest then live[#live + 1] = {index, tonumber(s.raw[j + 1])} end
  end
  table.sort(live, function(a, b) return a[1] < b[1] end)
  local need = s.hits
  if need < 1 then need = 1 end
  local excess = s.total + need - s.limit
  local freed, reset = 0, 0
  for _, slice in ipairs(live) do
    freed = freed + slice[2]
    reset = leave_after(s, slice[1])
    if freed >= excess then break end
  end
  return reset
end

local out = {}
for i = 1, n do
  local s = state[i]
  local before = s.total
  local after = before
  local first = s.first
  if s.ok and commit and not denied and s.hits > 0 then
    redis.call('HINCRBY', KEYS[i], s.cur, s.hits)
    redis.call('PEXPIRE', KEYS[i], math.ceil((s.window + 2 * s.width) / 1000))
    after = before + s.hits
    if first == nil then first = s.cur end
  end
  local reset = 0
  if s.ok then
    if first ~= nil then reset = leave_after(s, first) end
  else
    reset = wait_for_room(s)
  end
  local remaining = s.limit - after
  if remaining < 0 then remaining = 0 end
  local admitted = 0
  if s.ok then admitted = 1 end
  out[#out + 1] = admitted
  out[#out + 1] = before
  out[#out + 1] = remaining
  out[#out + 1] = reset
end
return out
