-- fleet_sync.lua: fold one process's probabilistic counts into the fleet totals.
--
-- Each bucket is a hash with the fleet token bucket (twin: storage/embedded.py
-- _FleetBucket, with core/drop_ratio.py refill, take and zone_limit; the capacity
-- comes from drop_ratio.capacity: the limit, or the rule's burst). What each sync
-- reads and writes is one field, 'v', packed (struct '<dddddddd', eight doubles;
-- decoder: storage/script_calls.py fleet_state): the tokens, when they were last
-- updated (microseconds), the monotonic count of offered hits, the count of admitted
-- hits (a report giving back credit paid in advance lowers it: core/stretch.py
-- prepaid_wait), when the bucket's score in a zone's index was last renewed, when a
-- rolling bucket's hash expires (both microseconds, 0 for none), and the limit per
-- window and the window (microseconds) the bucket was last synced with. One packed
-- field instead of a field per figure: the store finds one field, and the script
-- neither formats nor parses numbers as text (about half a sync's time;
-- docs/scale.md, "Where the floor is"). A hash of an earlier layout (a field per
-- figure: 'tk', 'ts', 'o', 'a', 'x', 'i') is read once and moved into 'v'. A sorted
-- set of node ids scored by last sync time gives the number of live nodes. A rolling
-- bucket's expiry is pushed back (a minute past what it must outlive) only when it
-- comes within that, not on every sync.
--
-- A calendar budget's bucket (one key per period, core/calendar.py counted_under; its
-- report says when the period ends) starts full and does not refill: it holds what
-- is left of the period's budget, and expires a minute after the period's end
-- (core/calendar.py KEPT_AFTER_END: from the end on, the service counts the next
-- period under a key of its own; hits of the period reported just after it still
-- find their bucket).
--
-- In a zone (serve --zone) this is the zone's store: the bucket then refills at the
-- zone's part of the limit, 'Z' (thousandths of a hit per second, written by the
-- zone's aggregator, engine/zone_aggregator.py), when it is below the limit, its
-- capacity in proportion (core/drop_ratio.py zone_limit); until its first part comes
-- back, at the limit over the number of zones (the aggregator keeps that count); and
-- the hash keeps for the aggregator 'K' the bucket's key, 'L' the limit per window,
-- 'W' the window (microseconds), written when they change, 'c' when the bucket was
-- created (microseconds), with an index of live buckets (a sorted set scored by last
-- sync, renewed at most once a second, so the score lags the last sync by a second at
-- most, and the index takes a write a second per bucket, not one per replica's sync).
-- A calendar budget's bucket in a zone holds what the zone may still admit of the
-- fleet's budget: 'T', the admitted total the zone may reach, written by the
-- aggregator from the global store's count of the period (at first, what a new bucket
-- holds), less the admitted count; 'E' keeps when its period ends (microseconds) for
-- the aggregator.
--
-- ARGV[1]   this node's id, or '' for no heartbeat (Redis Cluster: the registry lives
--           in another slot and gets its own call)
-- KEYS      with a heartbeat, KEYS[1] is the node registry (sorted set); then the
--           fleet hashes of the buckets, in order; then, in a zone, the index and the
--           count of zones
-- ARGV[2]   node time-to-live in microseconds (a node silent longer is not counted)
-- ARGV[3]   '1' in a zone (the last two keys are the index and the count of zones),
--           '' otherwise
-- ARGV[4]   the buckets' reports, packed (struct '<dddddd' each, in the keys' order;
--           encoder: storage/script_calls.py sync_args): window_us, limit, capacity,
--           admitted delta, offered delta, a calendar budget's microseconds to its
--           period's end (-1 for a rolling bucket). One argument for them all: Redis
--           reads and hands the script one string, not seven per bucket, and the
--           script parses no number from text
-- ARGV[4 + i] in a zone: bucket i's key
-- Returns   {live nodes (-1 without heartbeat), then 3 integers per bucket:
--            tokens in thousandths, offered total, the limit the bucket refilled at
--            in thousandths (a calendar budget's: the limit it holds, as a zone's
--            part scales it; it does not refill)}
-- Time comes from the Redis server (TIME), so service clocks may disagree freely.

local call, tonumber, tostring, format = redis.call, tonumber, tostring, string.format
local floor, ceil = math.floor, math.ceil
local ARGV, KEYS = ARGV, KEYS
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local node_ttl = tonumber(ARGV[2])
-- Numbers go to redis.call as strings formatted here: Redis's own conversion of a Lua
-- number costs more than the command, and tostring() keeps only 14 digits (the
-- microsecond clock has 16).
local stamp_text = format('%d', now)
local REFRESH_MS = 60000 -- a key's expiry is pushed back this far past what it must outlive
local REINDEX_US = 1000000 -- a bucket's score in a zone's index is renewed at most this often

local first = 1
local out = {-1}
if ARGV[1] ~= '' then
  call('ZADD', KEYS[1], stamp_text, ARGV[1])
  call('ZREMRANGEBYSCORE', KEYS[1], '-inf', format('%d', now - node_ttl))
  call('PEXPIRE', KEYS[1], format('%d', math.ceil(node_ttl / 1000) + 1000))
  out[1] = call('ZCARD', KEYS[1])
  first = 2
end

local index_key = nil
local zones = nil
local last = #KEYS
if ARGV[3] == '1' then
  index_key = KEYS[#KEYS - 1]
  zones = tonumber(call('GET', KEYS[#KEYS]))
  last = #KEYS - 2
end

-- One pass per bucket: one read (HGET, in a zone HMGET with the aggregator's fields),
-- one write of 'v' (HSET); the fields that only change with the bucket (its creation,
-- key, limit, window) are written with it when they do, its expiry when it comes near,
-- and the index gets one ZADD per call.
local pack, unpack_state = struct.pack, struct.unpack
local STATE = '<dddddddd'
local REPORT, REPORT_SIZE = '<dddddd', 48
local reports = ARGV[4]
local indexed = {}
local n = #out
for i = 1, last - first + 1 do
  local key = KEYS[first + i - 1]
  local window, rule_limit, capacity, admitted, offered, ends =
    unpack_state(REPORT, reports, REPORT_SIZE * (i - 1) + 1)
  if ends < 0 then ends = nil end
  local limit = rule_limit
  local state
  if index_key then
    state = call('HMGET', key, 'v', 'Z', 'T')
  else
    state = {call('HGET', key, 'v')}
  end
  local tokens, stamp, offered_before, admitted_before, indexed_at, expires, known_limit, known_window
  if state[1] then
    tokens, stamp, offered_before, admitted_before, indexed_at, expires, known_limit,
      known_window = unpack_state(STATE, state[1])
  else
    -- new, or of the earlier layout: its fields are read once and moved into 'v'
    local old = call('HMGET', key, 'tk', 'ts', 'o', 'a', 'x', 'i', 'L', 'W')
    if old[1] then call('HDEL', key, 'tk', 'ts', 'o', 'a', 'x', 'i') end
    tokens, stamp = tonumber(old[1]), tonumber(old[2])
    offered_before, admitted_before = tonumber(old[3]) or 0, tonumber(old[4]) or 0
    expires, indexed_at = tonumber(old[5]) or 0, tonumber(old[6]) or 0
    known_limit, known_window = tonumber(old[7]) or -1, tonumber(old[8]) or -1
  end
  local zone_part = tonumber(state[2])
  local zone_limit = nil
  if zone_part ~= nil then
    zone_limit = zone_part * window / 1000000000
  elseif zones ~= nil and zones > 1 then
    zone_limit = limit / zones
  end
  if zone_limit ~= nil and zone_limit < limit then
    capacity = capacity * zone_limit / limit
    limit = zone_limit
  end
  local created = tokens == nil or stamp == nil
  if created then
    tokens = capacity
  elseif ends == nil then
    local elapsed = now - stamp
    if elapsed < 0 then elapsed = 0 end
    tokens = tokens + elapsed * limit / window
    if tokens > capacity then tokens = capacity end
  end
  local admitted_total = admitted_before + admitted
  if ends ~= nil and index_key then
    local allot = tonumber(state[3])
    if allot == nil then
      allot = capacity
      call('HSET', key, 'T', tostring(allot), 'E', format('%d', now + ends))
    end
    tokens = allot - admitted_before
  end
  tokens = tokens - admitted
  if tokens < -limit then tokens = -limit end
  local offered_total = offered_before + offered
  if index_key and (created or now - indexed_at >= REINDEX_US) then
    indexed_at = now
    indexed[#indexed + 1] = stamp_text
    indexed[#indexed + 1] = key
  end
  -- A rolling bucket is kept one window past full refill plus a minute (after that it
  -- is a full bucket), its expiry pushed back only when it comes within that; a
  -- calendar budget's, a minute past its period's end (or past this report, when it
  -- comes after the end).
  local expire_ms = nil
  if ends ~= nil then
    expire_ms = math.ceil(math.max(ends, 0) / 1000) + 60000
  else
    local keep_ms = ceil(window / 1000) * 2 + 60000
    if expires - now < keep_ms * 1000 then
      expire_ms = keep_ms + REFRESH_MS
      expires = now + expire_ms * 1000
    end
  end
  local packed = pack(STATE, tokens, now, offered_total, admitted_total, indexed_at, expires,
    rule_limit, window)
  if index_key and created then
    call('HSET', key, 'v', packed, 'K', ARGV[4 + i], 'L', format('%.17g', rule_limit),
      'W', format('%d', window), 'c', stamp_text)
  elseif index_key and (known_limit ~= rule_limit or known_window ~= window) then
    call('HSET', key, 'v', packed, 'K', ARGV[4 + i], 'L', format('%.17g', rule_limit),
      'W', format('%d', window))
  else
    call('HSET', key, 'v', packed)
  end
  if expire_ms then call('PEXPIRE', key, format('%d', expire_ms)) end
  out[n + 1] = floor(tokens * 1000)
  out[n + 2] = offered_total
  out[n + 3] = floor(limit * 1000)
  n = n + 3
end
for i = 1, #indexed, 400 do
  call('ZADD', index_key, unpack(indexed, i, math.min(i + 399, #indexed)))
end
return out
