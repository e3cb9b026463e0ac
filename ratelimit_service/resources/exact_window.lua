-- exact_window.lua: exact sliding-window decisions for a batch of requests.
--
-- Same arithmetic as ratelimit_service/core/window.py and core/exact.py: a window of
-- T microseconds is cut into S slices; a key is a hash {slice index -> hits}; the
-- window at `now` holds slices cur-S .. cur (cur = floor(now / (T/S))). Within one
-- request every hit is checked first; the request is denied if an enforcing
-- descriptor does not fit, or if every quota descriptor does not fit; only an
-- admitted request consumes. Requests are decided one after the other, so a later
-- request in the batch sees what an earlier one consumed: the batch is exactly the
-- same as R separate calls, with one round trip and one script call instead of R.
--
-- KEYS     the window hashes of every descriptor of every request, in request order
--          (fields: slice index -> hits, plus the bookkeeping fields n, o and c below)
-- ARGV[1]  S, slices per window
-- ARGV[2]  R, requests in the batch
-- then, per request: commit (1 = consume if admitted, 0 = check only), n (its
--          descriptors), then per descriptor: limit, window_us, hits, role
--          (role 0 = enforce, 1 = shadow: never denies, 2 = quota)
-- Returns  a flat array, 4 integers per descriptor, in KEYS order:
--          admitted (1/0), hits in the window before, remaining after, reset_after_us
--          (admitted: until the oldest slice leaves; denied: until the hits would fit)
-- Time comes from the Redis server (TIME), so service clocks may disagree freely.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local slices = tonumber(ARGV[1])
local requests = tonumber(ARGV[2])

-- A key also holds three bookkeeping fields: n, the hits in its live slices, o, the
-- index of its oldest live slice, and c, the index of its newest. While o is inside
-- the window nothing has expired and the decision needs only these fields (HMGET),
-- not every slice: the slices are read (HGETALL) only when one has expired, at most
-- once per slice width, or when a denied hit needs its wait. The key's expiry is set
-- only when a hit opens a new slice (c grows): set then to outlive that slice by a
-- slice width, it outlives every older one too, so the other hits skip a PEXPIRE.
--
-- Each key is read once per batch and then kept in `windows`, updated as hits are
-- consumed: a batch often repeats the same few keys.
local windows = {}

-- Every live slice, {index -> hits}; expired slices are deleted on the way.
local function read_slices(w)
  local raw = redis.call('HGETALL', w.key)
  local stale, live, total, first = {}, {}, 0, nil
  for j = 1, #raw, 2 do
    local index = tonumber(raw[j])
    if index ~= nil then  -- not n or o
      if index < w.oldest then
        stale[#stale + 1] = raw[j]
      else
        local hits = tonumber(raw[j + 1])
        live[index] = hits
        total = total + hits
        if first == nil or index < first then first = index end
      end
    end
  end
  if #stale > 0 then redis.call('HDEL', w.key, unpack(stale)) end
  w.live, w.total, w.first = live, total, first
end

local function load(key, window)
  local w = windows[key]
  if w ~= nil then return w end
  local width = window / slices
  local cur = math.floor(now / width)
  w = {key = key, width = width, window = window, cur = cur, oldest = cur - slices,
       live = nil, changed = false, extend = false}
  local meta = redis.call('HMGET', key, 'n', 'o', 'c')
  w.total, w.first, w.newest = tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3])
  if w.total == nil or (w.first ~= nil and w.first < w.oldest) then
    read_slices(w)  -- a slice expired (or no bookkeeping yet): recount
    w.changed = true
  end
  windows[key] = w
  return w
end

local function leave_after(w, index)
  local at = (index + slices + 1) * w.width - now
  if at < 0 then return 0 end
  return math.floor(at)
end

-- Microseconds until a denied hit would fit: walk the live slices oldest first until
-- enough hits have left the window.
local function wait_for_room(h)
  local w = h.w
  if w.live == nil then read_slices(w) end
  local indexes = {}
  for index in pairs(w.live) do indexes[#indexes + 1] = index end
  table.sort(indexes)
  local need = h.hits
  if need < 1 then need = 1 end
  local excess = w.total + need - h.limit
  local freed, reset = 0, 0
  for _, index in ipairs(indexes) do
    freed = freed + w.live[index]
    reset = leave_after(w, index)
    if freed >= excess then break end
  end
  return reset
end

local out = {}
local arg, key_index = 3, 1
for _ = 1, requests do
  local commit = ARGV[arg] == '1'
  local n = tonumber(ARGV[arg + 1])
  arg = arg + 2
  local batch = {}
  local denied, quota_seen, quota_all_over = false, false, true
  for i = 1, n do
    local w = load(KEYS[key_index], tonumber(ARGV[arg + 1]))
    local h = {w = w, limit = tonumber(ARGV[arg]), hits = tonumber(ARGV[arg + 2]),
               role = tonumber(ARGV[arg + 3])}
    local need = h.hits
    if need < 1 then need = 1 end
    h.ok = w.total + need <= h.limit
    if h.role == 0 and not h.ok then denied = true end
    if h.role == 2 then
      quota_seen = true
      if h.ok then quota_all_over = false end
    end
    batch[i] = h
    arg = arg + 4
    key_index = key_index + 1
  end
  if quota_seen and quota_all_over then denied = true end

  -- Every descriptor's "before" is read before any of this request's hits land.
  for i = 1, n do batch[i].before = batch[i].w.total end
  for i = 1, n do
    local h = batch[i]
    local w = h.w
    if h.ok and commit and not denied and h.hits > 0 then
      redis.call('HINCRBY', w.key, w.cur, h.hits)
      if w.live ~= nil then w.live[w.cur] = (w.live[w.cur] or 0) + h.hits end
      w.total = w.total + h.hits
      if w.first == nil then w.first = w.cur end
      w.changed = true
      if w.newest == nil or w.newest < w.cur then
        w.newest, w.extend = w.cur, true  -- a new slice: the key must outlive it
      end
    end
  end
  for i = 1, n do
    local h = batch[i]
    local w = h.w
    local reset = 0
    local after = h.before
    if h.ok then
      if commit and not denied and h.hits > 0 then after = after + h.hits end
      if w.first ~= nil then reset = leave_after(w, w.first) end
    else
      reset = wait_for_room(h)
    end
    local remaining = h.limit - after
    if remaining < 0 then remaining = 0 end
    local admitted = 0
    if h.ok then admitted = 1 end
    out[#out + 1] = admitted
    out[#out + 1] = h.before
    out[#out + 1] = remaining
    out[#out + 1] = reset
  end
end

for _, w in pairs(windows) do
  if w.changed then
    if w.first == nil then
      redis.call('DEL', w.key)  -- every slice expired: nothing left to keep
    else
      if w.newest == nil then
        redis.call('HSET', w.key, 'n', w.total, 'o', w.first)
      else
        redis.call('HSET', w.key, 'n', w.total, 'o', w.first, 'c', w.newest)
      end
      if w.extend then
        redis.call('PEXPIRE', w.key, math.ceil((w.window + 2 * w.width) / 1000))
      end
    end
  end
end
return out
