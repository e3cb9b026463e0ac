-- quota_tier.lua: one member's (a replica's) RLQS totals per counter in, its part of
-- the limit out. Arithmetic twin: core/tiers.py (TierTable.publish, fair_part,
-- capped_part); rates are integer thousandths of a hit per second.
--
-- Each counter is two hashes and a sorted set that share a hash tag (one Cluster
-- slot). The counter's hash keeps what each publish reads and writes in one field,
-- 'v', packed (struct '<ddddddddd', nine doubles; decoder: storage/script_calls.py
-- counter_state): the sums of the live members' demands, instances and parts, the
-- current fixed window's index and the hits allowed in it (windows aligned to the
-- epoch), when the counter's score in a zone's index was last renewed and when its
-- keys expire (microseconds, 0 for none), and the rule's limit and window it was last
-- published with. One packed field: the store finds one field, and the script neither
-- formats nor parses the sums as text (docs/scale.md, "Where the floor is"). A hash of
-- an earlier layout (a field each: 'D', 'N', 'P', 'w', 'u', 'i', 'x') is read once and
-- moved into 'v'. The members' hash: per member (field: its name) its last demand,
-- instance count and part, packed (struct '<Bddd': a 0 byte, then the three; decoder:
-- storage/script_calls.py member_entry); an entry of an earlier layout, text
-- 'demand instances part', is read as well.
-- The sorted set scores each member by when it last published (microseconds). Members
-- silent longer than the forget time leave the sums, at most ARGV[4] per call (oldest
-- first), so the work per call does not grow with the fleet.
--
-- The members' entries live apart from the sums because Redis keeps a small hash
-- packed and finds a field by walking it: behind a hundred replicas the sums' hash
-- stays a dozen fields, and each call walks the members' hash once (docs/scale.md).
-- A member's entry in the counter's hash ('d:<name>', 'n:<name>', 'p:<name>', an
-- earlier layout) is read when the members' hash has none, and moved there.
--
-- The part: the fair one (demand plus the spare by instances under the limit, the
-- limit by demand over it, by instances with no demand yet), grown only into what the
-- other members' parts leave of the limit; a member heard from for the first time
-- gets at least its even share by instances.
--
-- In a zone (serve --zone) the replicas' store also keeps, per counter, what the
-- zone's aggregator (engine/zone_aggregator.py) reads and writes back: 'K' the
-- counter's key, 'R' the rule's limit (thousandths of a hit per second), 'W' its
-- window (microseconds); 'Z' the zone's part of the limit (thousandths; the parts
-- here divide Z, not the limit), 'G' the hits the whole fleet allowed in window 'gw'
-- as the global store counted them, of which 'g' came from this zone.
-- An index of live counters (a sorted set, scored by last publish) lets the aggregator
-- find them; a counter's score is renewed at most once a second (its packed state says
-- when: the score lags the last publish by a second at most, and the index takes a
-- write a second per counter, not one per replica's publish).
--
-- Fencing: a member that publishes with a token (a zone's aggregator, in the global
-- store) has the highest token seen from it kept per counter, 'f:<name>'; a call whose
-- token is lower than that on any of its counters is refused whole, before anything is
-- written (a deposed aggregator's late publish; twin: core/tiers.py publish_fenced).
--
-- KEYS      per counter: its hash, its sorted set, its members' hash; then, in a zone,
--           the index
-- ARGV[1]   this member's name
-- ARGV[2]   forget time in microseconds
-- ARGV[3]   the member's fencing token, or '' (a replica: no fencing)
-- ARGV[4]   the most silent members one call removes (core/tiers.py EXPIRE_PER_CALL)
-- ARGV[5]   the counters' reports, packed (struct '<ddddd' each, in the keys' order;
--           encoder: storage/script_calls.py tier_args): demand, instances, allowed
--           hits since the last publish, window in microseconds, limit (demand and
--           limit in thousandths of a hit per second). One argument for them all:
--           Redis reads and hands the script one string, not five per counter
-- ARGV[5 + i] in a zone: counter i's key
-- Returns   per counter: {part (thousandths), fleet demand (thousandths), fleet
--           instances, live members, allowed hits in the window (in a zone: the
--           fleet's, the global count plus what the zone allowed since), the limit the
--           parts divide (thousandths: the rule's, or the zone's part when lower)},
--           flattened;
--           or, refused, {-1, the highest token seen from the member}
-- Time comes from the Redis server (TIME), so service clocks may disagree freely.

local call, tonumber, format = redis.call, tonumber, string.format
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local me, forget = ARGV[1], tonumber(ARGV[2])
local REFRESH_MS = 60000 -- the keys' expiry is pushed back this far past what they must outlive
local REINDEX_US = 1000000 -- a counter's score in a zone's index is renewed at most this often

-- A member's last entry, {demand, instances, part} or nil: from the members' hash, or
-- (an earlier layout) the counter's hash, which it then leaves for the members' hash.
local pack, unpack_state, byte = struct.pack, struct.unpack, string.byte
local ENTRY = '<Bddd' -- a member's entry: a 0 byte (no text entry starts so), then its figures

local function entry(hash, entries, who)
  local packed = call('HGET', entries, who)
  if packed then
    if byte(packed, 1) == 0 then
      local _, d, n, p = unpack_state(ENTRY, packed)
      return {d, n, p}
    end
    local d, n, p = string.match(packed, '^(%S+) (%S+) (%S+)$') -- an earlier layout's text
    return {tonumber(d), tonumber(n), tonumber(p)}
  end
  local old = call('HMGET', hash, 'd:' .. who, 'n:' .. who, 'p:' .. who)
  if not old[1] then return nil end
  call('HDEL', hash, 'd:' .. who, 'n:' .. who, 'p:' .. who)
  return {tonumber(old[1]) or 0, tonumber(old[2]) or 0, tonumber(old[3]) or 0}
end

-- A silent member leaves: its entry goes, and what it added comes off the sums.
local function leave(hash, entries, who, sums)
  local gone = entry(hash, entries, who)
  if gone then
    sums[1] = sums[1] - gone[1]
    sums[2] = sums[2] - gone[2]
    sums[3] = sums[3] - gone[3]
    call('HDEL', entries, who)
  end
end

local counters = math.floor(#KEYS / 3)
local index_key = nil
if #KEYS > 3 * counters then index_key = KEYS[#KEYS] end
local token = tonumber(ARGV[3])
if token then
  local refused = nil
  for i = 1, counters do
    local seen = tonumber(call('HGET', KEYS[3 * i - 2], 'f:' .. me))
    if seen and seen > token and (refused == nil or seen > refused) then
      refused = seen
    end
  end
  if refused then return {-1, refused} end
end
-- One pass per counter: one read of the sums (HGET of 'v', in a zone HMGET with the
-- aggregator's fields) and one of the member's entry, the sums kept here, one write of
-- each; the fields that only change with the rule are written when they do, and the
-- index gets one ZADD per call.
local STATE = '<ddddddddd'
local REPORT, REPORT_SIZE = '<ddddd', 40
local reports = ARGV[5]
local out = {}
local indexed = {}
for i = 1, counters do
  local hash, members, entries = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local demand, instances, allowed, window, rule_limit =
    unpack_state(REPORT, reports, REPORT_SIZE * (i - 1) + 1)
  local limit = rule_limit
  -- Only a zone's store has the aggregator's fields: elsewhere they are not looked for.
  local state
  if index_key then
    state = call('HMGET', hash, 'v', 'Z', 'G', 'gw', 'g')
  else
    state = {call('HGET', hash, 'v')}
  end
  local sum_d, sum_n, sum_p, window_at, used_before, indexed_at, expires, known_limit,
    known_window
  if state[1] then
    sum_d, sum_n, sum_p, window_at, used_before, indexed_at, expires, known_limit,
      known_window = unpack_state(STATE, state[1])
  else
    -- new, or of the earlier layout: its fields are read once and moved into 'v'
    local old = call('HMGET', hash, 'D', 'N', 'P', 'w', 'u', 'i', 'x', 'R', 'W')
    if old[1] or old[4] then call('HDEL', hash, 'D', 'N', 'P', 'w', 'u', 'i', 'x') end
    sum_d, sum_n, sum_p = tonumber(old[1]) or 0, tonumber(old[2]) or 0, tonumber(old[3]) or 0
    window_at, used_before = tonumber(old[4]) or -1, tonumber(old[5]) or 0
    indexed_at, expires = tonumber(old[6]) or 0, tonumber(old[7]) or 0
    known_limit, known_window = tonumber(old[8]) or -1, tonumber(old[9]) or -1
  end
  local zone_part = tonumber(state[2])
  if zone_part ~= nil and zone_part < limit then limit = zone_part end
  local sums = {sum_d, sum_n, sum_p}
  local mine = entry(hash, entries, me)
  local heard = mine ~= nil
  local stale = call('ZRANGEBYSCORE', members, '-inf', format('(%d', now - forget),
    'LIMIT', '0', ARGV[4])
  for _, who in ipairs(stale) do
    if who ~= me then
      leave(hash, entries, who, sums)
      call('ZREM', members, who)
    else
      heard = false -- silent too long itself: it left, and is heard for the first time
    end
  end
  if mine then
    -- what this member added last time comes off the sums (it left, or is replaced)
    sums[1] = sums[1] - mine[1]
    sums[2] = sums[2] - mine[2]
    sums[3] = sums[3] - mine[3]
  end
  local first = not heard
  local fleet_demand = sums[1] + demand
  local fleet_instances = sums[2] + instances
  local others = sums[3]
  local everyone = math.max(fleet_instances, instances, 1)
  local d = math.max(fleet_demand, 0)
  local fair
  if d <= 0 then
    fair = limit * instances / everyone
  elseif d <= limit then
    fair = demand + (limit - d) * instances / everyone
  else
    fair = limit * math.min(demand, d) / d
  end
  local room = limit - others
  local most
  if first then
    most = math.max(room, limit * instances / everyone)
  else
    most = math.max(room, 0)
  end
  local part = math.floor(math.min(fair, most))
  local index = math.floor(now / window)
  local used = allowed
  if window_at == index then used = used_before + allowed end
  if index_key and now - indexed_at >= REINDEX_US then
    indexed_at = now
    indexed[#indexed + 1] = format('%d', now)
    indexed[#indexed + 1] = hash
  end
  -- The three keys outlive twice the window or forget time; their expiry is pushed
  -- back (a minute past that) when it comes within it, or when a member new to the
  -- counter may have made its sorted set and members' hash anew.
  local keep_ms = math.ceil(math.max(window, forget) * 2 / 1000)
  local ttl = nil
  if first or expires - now < keep_ms * 1000 then
    ttl = format('%d', keep_ms + REFRESH_MS)
    expires = now + (keep_ms + REFRESH_MS) * 1000
  end
  local packed = pack(STATE, fleet_demand, fleet_instances, others + part, index, used,
    indexed_at, expires, rule_limit, window)
  if index_key and (known_limit ~= rule_limit or known_window ~= window) then
    call('HSET', hash, 'v', packed, 'K', ARGV[5 + i], 'R', format('%d', rule_limit),
      'W', format('%d', window))
    if token then call('HSET', hash, 'f:' .. me, ARGV[3]) end
  elseif token then
    call('HSET', hash, 'v', packed, 'f:' .. me, ARGV[3])
  else
    call('HSET', hash, 'v', packed)
  end
  call('HSET', entries, me, pack(ENTRY, 0, demand, instances, part))
  call('ZADD', members, format('%d', now), me)
  if ttl then
    call('PEXPIRE', hash, ttl)
    call('PEXPIRE', members, ttl)
    call('PEXPIRE', entries, ttl)
  end
  if state[3] and tonumber(state[4]) == index then
    used = math.max(used, tonumber(state[3]) + used - (tonumber(state[5]) or 0))
  end
  out[#out + 1] = part
  out[#out + 1] = d
  out[#out + 1] = math.max(fleet_instances, 0)
  out[#out + 1] = call('ZCARD', members)
  out[#out + 1] = used
  out[#out + 1] = limit
end
for i = 1, #indexed, 400 do
  call('ZADD', index_key, unpack(indexed, i, math.min(i + 399, #indexed)))
end
return out
