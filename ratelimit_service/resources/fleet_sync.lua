-- fleet_sync.lua: fold one process's probabilistic counts into the fleet totals.
--
-- Each bucket is a hash with the fleet token bucket (twin: storage/embedded.py
-- _FleetBucket, with core/drop_ratio.py refill, take and zone_limit; the capacity
-- comes from drop_ratio.capacity: the limit, or the rule's burst): 'tk' tokens, 'ts'
-- when they were last updated (microseconds), 'o' the monotonic count of offered
-- hits. A sorted set of node ids scored by last sync time gives the number of live
-- nodes. 'x' is when a rolling bucket's hash expires (microseconds): its expiry is
-- pushed back (a minute past what it must outlive) only when it comes within that,
-- not on every sync.
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
-- 'W' the window (microseconds), 'a' the count of admitted hits (a report giving back
-- credit paid in advance lowers it: core/stretch.py prepaid_wait), 'c' when
-- the bucket was created (microseconds), with an index of live buckets (a sorted set
-- scored by last sync, renewed at most once a second: 'i' says when, so the score lags
-- the last sync by a second at most, and the index takes a write a second per bucket,
-- not one per replica's sync). A calendar budget's bucket in a zone holds what the zone may
-- still admit of the fleet's budget: 'T', the admitted total the zone may reach,
-- written by the aggregator from the global store's count of the period (at first,
-- what a new bucket holds), less 'a'; 'E' keeps when its period ends (microseconds)
-- for the aggregator.
--
-- ARGV[1]   this node's id, or '' for no heartbeat (Redis Cluster: the registry lives
--           in another slot and gets its own call)
-- KEYS      with a heartbeat, KEYS[1] is the node registry (sorted set); then the
--           fleet hashes of the buckets, in order; then, in a zone, the index and the
--           count of zones
-- ARGV[2]   node time-to-live in microseconds (a node silent longer is not counted)
-- ARGV[3]   '1' in a zone (the last two keys are the index and the count of zones),
--           '' otherwise
-- ARGV[4 + 7*(i-1) ...] for bucket i: window_us, limit, capacity, admitted delta,
--           offered delta, the bucket's key (in a zone; '' otherwise), a calendar
--           budget's microseconds to its period's end ('' for a rolling bucket)
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

-- One pass per bucket: one read (HMGET), one write of the counts (HSET), its expiry;
-- the fields that only change with the bucket (its creation, key, limit, window) are
-- written when they do, and the index gets one ZADD per call.
local indexed = {}
local n = #out
for i = 1, last - first + 1 do
  local key = KEYS[first + i - 1]
  local base = 4 + 7 * (i - 1)
  local window = tonumber(ARGV[base])
  local limit = tonumber(ARGV[base + 1])
  local capacity = tonumber(ARGV[base + 2])
  local admitted = tonumber(ARGV[base + 3])
  local ends = tonumber(ARGV[base + 6])
  local state = call('HMGET', key, 'tk', 'ts', 'Z', 'T', 'a', 'o', 'L', 'W', 'x', 'i')
  local zone_part = tonumber(state[3])
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
  local tokens = tonumber(state[1])
  local stamp = tonumber(state[2])
  local created = tokens == nil or stamp == nil
  if created then
    tokens = capacity
  elseif ends == nil then
    local elapsed = now - stamp
    if elapsed < 0 then elapsed = 0 end
    tokens = tokens + elapsed * limit / window
    if tokens > capacity then tokens = capacity end
  end
  local admitted_total = (tonumber(state[5]) or 0) + admitted
  if ends ~= nil and index_key then
    local allot = tonumber(state[4])
    if allot == nil then
      allot = capacity
      call('HSET', key, 'T', tostring(allot), 'E', format('%d', now + ends))
    end
    tokens = allot - (tonumber(state[5]) or 0)
  end
  tokens = tokens - admitted
  if tokens < -limit then tokens = -limit end
  local offered_total = (tonumber(state[6]) or 0) + tonumber(ARGV[base + 4])
  if index_key then
    local indexed_at = tonumber(state[10])
    if created or indexed_at == nil or now - indexed_at >= REINDEX_US then
      call('HSET', key, 'tk', tostring(tokens), 'ts', stamp_text,
        'o', format('%d', offered_total), 'a', format('%d', admitted_total), 'i', stamp_text)
      indexed[#indexed + 1] = stamp_text
      indexed[#indexed + 1] = key
    else
      call('HSET', key, 'tk', tostring(tokens), 'ts', stamp_text,
        'o', format('%d', offered_total), 'a', format('%d', admitted_total))
    end
    if created then call('HSET', key, 'c', stamp_text) end
    if created or state[7] ~= ARGV[base + 1] or state[8] ~= ARGV[base] then
      call('HSET', key, 'K', ARGV[base + 5], 'L', ARGV[base + 1], 'W', ARGV[base])
    end
  else
    call('HSET', key, 'tk', tostring(tokens), 'ts', stamp_text,
      'o', format('%d', offered_total))
  end
  if ends ~= nil then
    -- a calendar budget's: a minute past its period's end (or past this report, when
    -- it comes after the end)
    call('PEXPIRE', key, format('%d', math.ceil(math.max(ends, 0) / 1000) + 60000))
  else
    -- Kept one window past full refill plus a minute (after that it is a full bucket);
    -- the expiry pushed back only when it comes within that.
    local keep_ms = ceil(window / 1000) * 2 + 60000
    local expires = tonumber(state[9])
    if expires == nil or expires - now < keep_ms * 1000 then
      call('PEXPIRE', key, format('%d', keep_ms + REFRESH_MS))
      call('HSET', key, 'x', format('%d', now + (keep_ms + REFRESH_MS) * 1000))
    end
  end
  out[n + 1] = floor(tokens * 1000)
  out[n + 2] = offered_total
  out[n + 3] = floor(limit * 1000)
  n = n + 3
end
for i = 1, #indexed, 400 do
  call('ZADD', index_key, unpack(indexed, i, math.min(i + 399, #indexed)))
end
return out
