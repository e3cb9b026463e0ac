-- exact_window.lua: exact sliding-window decisions for a batch of requests.
--
-- Same arithmetic as ratelimit_service/core/window.py and core/exact.py: a window of
-- T microseconds is cut into S slices; a key is a hash {slice index -> hits}; the
-- window at `now` holds slices cur-S .. cur (cur = floor(now / (T/S))). Within one
-- request every hit is checked first; the request is denied if an enforcing
-- descriptor does not fit, or if every quota descriptor does not fit (core/exact.py
-- denies); a hit is counted if it fits and its request is admitted, and a cost hit
-- whatever the answer (core/exact.py counts; both held equal by
-- tests/storage/test_exact_script_vs_core.py). Requests are decided one after the
-- other, so a later request in the batch sees what an earlier one consumed: the batch
-- is exactly the same as R separate calls, with one round trip and one script call
-- instead of R.
--
-- KEYS     the window hashes of every descriptor of every request, in request order
--          (fields: slice index -> hits, plus the bookkeeping fields sum, first and
--          last below)
-- ARGV[1]  S, slices per window
-- ARGV[2]  R, requests in the batch
-- then, per request: commit (1 = decide and count, 0 = check only, 2 = count
--          whatever the window holds: hits admitted while Redis was unavailable, see
--          storage/owed_hits.py, 3 = the request is denied already: count its costs
--          only), n (its descriptors), then per descriptor: limit, window_us, hits,
--          role (0 = enforce, 1 = shadow: never denies, 2 = quota; plus 4 when the hit
--          is a cost, counted whatever the answer: core/exact.py is_cost)
-- Returns  a flat array, 4 integers per descriptor, in KEYS order:
--          admitted (1/0), hits in the window before, remaining after, reset_after_us
--          (admitted: until the oldest slice leaves; denied: until the hits would fit;
--          at most window_us: a slice leaves up to a slice width after that, but a
--          reset is never reported longer than the window, as core/exact.py evaluate)
-- Time comes from the Redis server (TIME), so service clocks may disagree freely.

local call, tonumber, floor, format = redis.call, tonumber, math.floor, string.format
local ENFORCE, QUOTA, COST = 0, 2, 4  -- roles: core/exact.py HitRole; COST: a cost's flag
local CHECK, COMMIT, FORCE = 0, 1, 2  -- commit: core/exact.py, storage/exact_batcher.py FORCE
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local slices = tonumber(ARGV[1])
local requests = tonumber(ARGV[2])

-- A key also holds three bookkeeping fields: sum, the hits in its live slices, first,
-- the index of its oldest live slice, and last, the index of its newest. While first
-- is inside the window nothing has expired and the decision needs only these fields
-- (HMGET), not every slice: the slices are read (HGETALL) only when one has expired,
-- at most once per slice width, or when a denied hit needs its wait. The key's expiry
-- is set only when a hit opens a new slice (last grows): set then to outlive that
-- slice by a slice width, it outlives every older one too, so the other hits skip a
-- PEXPIRE.
--
-- Each key is read once per batch and then kept in `windows`, updated as hits are
-- consumed: a batch often repeats the same few keys. Writes wait until the end: one
-- HINCRBY of the slice and one of sum per key (sum, first and last are rewritten whole
-- when the call has read the slices), with numbers formatted here, since Redis turns a
-- Lua number argument into a string with a printf of its own, which costs more than
-- the command itself.
local windows = {}
local BOOKKEEPING = {sum = true, first = true, last = true}

-- Every live slice, {index -> hits}; expired slices are deleted on the way, and so is
-- any field that is neither a slice nor sum, first or last (another layout's).
local function read_slices(w)
  local raw = call('HGETALL', w.key)
  local stale, live, total, first = {}, {}, 0, nil
  for j = 1, #raw, 2 do
    local index = tonumber(raw[j])
    if index == nil then
      if BOOKKEEPING[raw[j]] == nil then stale[#stale + 1] = raw[j] end
    else
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
  if #stale > 0 then call('HDEL', w.key, unpack(stale)) end
  if w.added > 0 then  -- this call's hits, not written yet (see the end)
    live[w.cur] = (live[w.cur] or 0) + w.added
    total = total + w.added
    if first == nil then first = w.cur end
  end
  -- Rewrite sum, first and last whole at the end: they now come from the slices
  -- themselves (a stale slice deleted here may still be counted in sum if the clock
  -- stepped back).
  w.live, w.total, w.first, w.recount = live, total, first, true
end

local function load(key, window)
  local w = windows[key]
  if w ~= nil then return w end
  local width = window / slices
  local cur = floor(now / width)
  local meta = call('HMGET', key, 'sum', 'first', 'last')
  w = {key = key, width = width, window = window, cur = cur, oldest = cur - slices,
       total = tonumber(meta[1]), first = tonumber(meta[2]), newest = tonumber(meta[3]),
       live = false, recount = false, extend = false, added = 0}
  if w.total == nil or (w.first ~= nil and w.first < w.oldest) then
    read_slices(w)  -- a slice expired (or no bookkeeping yet): recount
  end
  windows[key] = w
  return w
end

local function leave_after(w, index)
  local at = (index + slices + 1) * w.width - now
  if at < 0 then return 0 end
  return floor(at)
end

-- Microseconds until a denied hit of `hits` would fit under `limit`: walk the live
-- slices oldest first until enough hits have left the window.
local function wait_for_room(w, hits, limit)
  if not w.live then read_slices(w) end
  local indexes = {}
  for index in pairs(w.live) do indexes[#indexes + 1] = index end
  table.sort(indexes)
  if hits < 1 then hits = 1 end
  local excess = w.total + hits - limit
  local freed, reset = 0, 0
  for _, index in ipairs(indexes) do
    freed = freed + w.live[index]
    reset = leave_after(w, index)
    if freed >= excess then break end
  end
  return reset
end

-- One request's descriptors, in parallel arrays reused from request to request (a
-- table per descriptor costs more than the arithmetic).
local hw, hlimit, hhits, hok, hbefore, hcost = {}, {}, {}, {}, {}, {}
local out, o = {}, 0
local arg, key_index = 3, 1
for _ = 1, requests do
  local commit_arg = tonumber(ARGV[arg])
  local commit, force = commit_arg == COMMIT, commit_arg == FORCE
  local n = tonumber(ARGV[arg + 1])
  arg = arg + 2
  local enforce_over, quota_seen, quota_admitted = false, false, false
  for i = 1, n do
    local w = load(KEYS[key_index], tonumber(ARGV[arg + 1]))
    local limit, hits = tonumber(ARGV[arg]), tonumber(ARGV[arg + 2])
    local role, cost = tonumber(ARGV[arg + 3]), false
    if role >= COST then role, cost = role - COST, true end
    local need = hits
    if need < 1 then need = 1 end
    local ok = w.total + need <= limit
    if role == ENFORCE then
      if not ok then enforce_over = true end
    elseif role == QUOTA then
      quota_seen = true
      if ok then quota_admitted = true end
    end
    -- "before" is read before any of this request's hits land.
    hw[i], hlimit[i], hhits[i], hok[i], hbefore[i], hcost[i] = w, limit, hits, ok, w.total, cost
    arg = arg + 4
    key_index = key_index + 1
  end
  -- The denial rule: core/exact.py denies.
  local denied = enforce_over or (quota_seen and not quota_admitted)
  local consume = commit and not denied
  local counting = commit_arg ~= CHECK

  -- Hits land descriptor by descriptor, each reported with the window as it then
  -- stands (as core/exact.py does): a key repeated in a request sees the hits of its
  -- earlier descriptors.
  for i = 1, n do
    local w, hits, limit = hw[i], hhits[i], hlimit[i]
    local ok = hok[i] or force
    -- Counted: core/exact.py counts (a forced hit always).
    if counting and hits > 0 and (force or (ok and consume) or hcost[i]) then
      w.added = w.added + hits
      if w.live then w.live[w.cur] = (w.live[w.cur] or 0) + hits end
      w.total = w.total + hits
      if w.first == nil then w.first, w.recount = w.cur, true end
      if w.newest == nil or w.newest < w.cur then
        w.newest, w.extend = w.cur, true  -- a new slice: the key must outlive it
      end
    end
    local reset, admitted = 0, 0
    if ok then
      admitted = 1
      if w.first ~= nil then reset = leave_after(w, w.first) end
    else
      reset = wait_for_room(w, hits, limit)
    end
    if reset > w.window then reset = w.window end  -- core/exact.py evaluate
    local remaining = limit - w.total
    if remaining < 0 then remaining = 0 end
    local before = hbefore[i]
    out[o + 1], out[o + 2], out[o + 3], out[o + 4] = admitted, before, remaining, reset
    o = o + 4
  end
end

for _, w in pairs(windows) do
  local key = w.key
  if w.added > 0 then
    local added = format('%d', w.added)
    call('HINCRBY', key, format('%d', w.cur), added)
    if not w.recount then call('HINCRBY', key, 'sum', added) end
  end
  if w.recount then
    if w.first == nil then
      call('DEL', key)  -- every slice expired: nothing left to keep
    else
      local n, oldest = format('%d', w.total), format('%d', w.first)
      if w.newest == nil then
        call('HSET', key, 'sum', n, 'first', oldest)
      else
        call('HSET', key, 'sum', n, 'first', oldest, 'last', format('%d', w.newest))
      end
    end
  elseif w.extend then
    call('HSET', key, 'last', format('%d', w.newest))
  end
  if w.extend then
    call('PEXPIRE', key, format('%d', math.ceil((w.window + 2 * w.width) / 1000)))
  end
end
return out
