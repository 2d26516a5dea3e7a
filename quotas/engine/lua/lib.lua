-- Shared helpers, prepended to every script by quotas/engine/scripts.py.
-- Units: time in integer milliseconds from the server's TIME (or ARGV in tests);
-- cost in integer nano-USD; tokens, requests, credits, leases in whole units.

local BUCKETS = 10            -- a rolling window is counted in this many sub-window buckets
local DAY_MS = 86400000
local NEVER = -1              -- retry_after when the request can never pass (it is larger than the limit)

-- Standard functions as upvalues, far cheaper than a global lookup each time. A Functions library is
-- loaded with no standard library in reach, so they are bound on the first call (scripts.py has every
-- function start with `if not floor then bind() end`).
local floor, ceil, max, min, sunpack, spack, ssub, concat, unpack_list
local function bind()
  floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
  sunpack, spack, ssub, concat, unpack_list = struct.unpack, struct.pack, string.sub, table.concat, unpack
end

-- Now, in ms, as a number and as text (the text made from TIME's own digits: formatting numbers
-- is among the costliest things a script does).
local function now_ms(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg), arg end
  local t = redis.call('TIME')
  local ms = string.sub('000000' .. t[2], -6, -4)     -- microseconds -> the 3 digits of milliseconds
  return tonumber(t[1]) * 1000 + tonumber(ms), t[1] .. ms
end

local function int(x)          -- a whole number as text, without exponent
  return string.format('%.0f', x)
end

local function split(s, sep)          -- plain separator; empty parts kept ("a||b" -> a, "", b)
  local out, start = {}, 1
  while true do
    local i = string.find(s, sep, start, true)
    if not i then out[#out + 1] = string.sub(s, start); return out end
    out[#out + 1] = string.sub(s, start, i - 1)
    start = i + 1
  end
end

-- Calendar periods (UTC). Days <-> civil dates, after H. Hinnant's algorithms.
local function civil_from_days(z)
  z = z + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = floor(y / 400)
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- start and end (ms) of the calendar period holding `now`
local function period_bounds(period, now)
  local days = floor(now / DAY_MS)
  if period == 'day' then return days * DAY_MS, (days + 1) * DAY_MS end
  local y, m = civil_from_days(days)
  local ny, nm = y, m + 1
  if nm == 13 then ny, nm = y + 1, 1 end
  return days_from_civil(y, m, 1) * DAY_MS, days_from_civil(ny, nm, 1) * DAY_MS
end

-- Counter state of a node: one string (aq:{org}:s:LEVEL:NODE) holding a record per limit, packed
-- with `struct`: the limit's 8-character id, a kind byte, then little-endian doubles:
--   'w' rolling window: newest bucket written (-1: none), ring total, counts of the ring's SLOTS buckets
--                       (bucket k = floor(t / (window / BUCKETS)) lives in slot k % SLOTS)
--   'b' token bucket:   tokens, when last refilled (ms)
--   'p' calendar:       period start (ms), count
-- A check reads each level's state with one read and writes it back with one SET (the TTL with it):
-- no per-field lookups and no text-to-number conversions on the hot path. Reading unpacks only each
-- record's first two numbers (all a 'b' or 'p' record has; a window's newest bucket and total): a
-- window's ring is unpacked only when a bucket leaves the window or the ring advances. A charge to
-- the newest bucket (most calls) rewrites the record from its old bytes with two numbers replaced.
local SLOTS = BUCKETS + 1
local HEAD_FMT = '<c9dd'                  -- id and kind as one string, then the first two numbers
-- (written out: a Functions library is loaded with no `string` in reach; 'w' has 2 + SLOTS doubles)
local SLOTS_FMT = '<ddddddddddd'
local RECORD_FMT = {w = '<c8c1ddddddddddddd', b = '<c8c1dd', p = '<c8c1dd'}
local LEVEL_TEXT = {'1', '2', '3', '4'}

local function kind_of(lim) return lim.b and 'b' or (lim.w and 'w' or 'p') end

local function slot_index(b) return 3 + b % SLOTS end
local RECORD_BYTES = {w = 9 + 8 * (2 + SLOTS), b = 9 + 16, p = 9 + 16}
local W_BYTES = RECORD_BYTES.w

-- A record: one limit's counter state, {id, kind, v (the numbers), present, b, st (its level's state),
-- at (its position in st.packed), loaded (v holds all its numbers), patch (false, or the ring slot
-- that a charge changed besides the total, with v[2] and that slot as the only changes)}. An override
-- and the limit it replaces share an id, so they share one record (their counts carry over when one
-- takes the other's place). Records live with the cached policy and are filled in place on each call.
local function clear_record(rec, now)
  local v = rec.v
  if rec.kind == 'w' then
    v[1] = -1
    for i = 2, 2 + SLOTS do v[i] = 0 end
  elseif rec.kind == 'b' then
    v[1], v[2] = rec.b, now
  else
    v[1], v[2] = 0, 0
  end
  rec.present, rec.loaded, rec.patch = false, true, false
end

-- Read a node's state into the records of the policy's limits of that level. Records of limits the
-- policy no longer has are skipped, and dropped when the state is written back. `packed` is the
-- key's value when the caller already read it (false: no such key), nil to GET it here.
local function read_state(policy, level, key, now, packed)
  local st = policy.states[level]
  if packed == nil then packed = redis.call('GET', key) end
  packed = packed or ''
  st.key, st.packed, st.dirty, st.renew, st.min_ttl = key, packed, false, false, 0
  local records, by_head = policy.records[level], policy.by_head[level]
  for i = 1, #records do records[i].present = false end
  local pos, len = 1, #packed
  while pos <= len do
    local head, v1, v2 = sunpack(HEAD_FMT, packed, pos)
    local rec = by_head[head]
    if rec then
      local v = rec.v
      v[1], v[2] = v1, v2
      rec.present, rec.at, rec.loaded, rec.patch = true, pos, rec.kind ~= 'w', false
      pos = pos + RECORD_BYTES[rec.kind]
    else
      pos = pos + RECORD_BYTES[ssub(head, 9)]          -- a limit the policy no longer has: dropped
    end
  end
  for i = 1, #records do
    if not records[i].present then clear_record(records[i], now) end
  end
  return st
end

-- The ring of a window record, unpacked from its level's state when first needed.
-- A slot already patched by a charge of this call (check_batch.lua charges a record more than once)
-- keeps its count.
local function load_slots(rec)
  if rec.loaded then return end
  local v, k = rec.v, rec.patch
  local patched = k and v[3 + k]
  v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12], v[13] = sunpack(SLOTS_FMT, rec.st.packed, rec.at + 25)
  if k then v[3 + k] = patched end
  rec.loaded = true
end

-- A level's state packed into one string: the level's records that exist ('' if none does).
local function pack_state(policy, level)
  local st = policy.states[level]
  local records, parts, n, packed = policy.records[level], st.parts, 0, st.packed
  for i = 1, #records do
    local rec = records[i]
    if rec.present then
      local v, at = rec.v, rec.at
      if rec.patch then                                -- id, kind, newest as they were; total; the slot
        local k = rec.patch
        parts[n + 1] = ssub(packed, at, at + 16)
        parts[n + 2] = spack('<d', v[2])
        parts[n + 3] = ssub(packed, at + 25, at + 24 + 8 * k)
        parts[n + 4] = spack('<d', v[3 + k])
        parts[n + 5] = ssub(packed, at + 33 + 8 * k, at + W_BYTES - 1)
        n = n + 5
      elseif not rec.loaded then                       -- a window not charged in this call: as it was
        n = n + 1
        parts[n] = ssub(packed, at, at + W_BYTES - 1)
      else
        n = n + 1
        parts[n] = spack(RECORD_FMT[rec.kind], rec.id, rec.kind, unpack_list(v))
      end
    end
  end
  return concat(parts, '', 1, n)
end

-- Store a packed state: with a TTL of `ttl` ms, or the TTL the key has (nil); '' deletes the key.
local function store_state(key, packed, ttl)
  if packed == '' then
    redis.call('DEL', key)
  elseif ttl then
    redis.call('SET', key, packed, 'PX', ttl)
  else
    redis.call('SET', key, packed, 'KEEPTTL')
  end
end

-- A cell: one limit evaluated in one call, on its record. Cells live with the cached policy and are
-- reset on each use: scripts never run concurrently, and a table that has its fields costs nothing to fill.
local function new_cell(lim, st, now, x)
  local c = lim.cell
  c.st, c.v, c.x = st, lim.rec.v, x
  if lim.kind == 'w' then local q = now / lim.g; c.slot = q - q % 1 else c.slot = 0 end  -- floor, without a C call
  return c                                             -- evaluate() sets the rest
end

-- Decoded agent policies, by their text (decoding is the costliest step of a check), with what can be
-- derived once: each limit's kind, bucket size, record and cell; each level's records by id.
local POLICY_CACHE_SIZE = 10000
local policy_cache, policy_cached = {}, 0
local function decode_policy(blob)
  local policy = policy_cache[blob]
  if policy then return policy end
  if policy_cached >= POLICY_CACHE_SIZE then policy_cache, policy_cached = {}, 0 end
  policy = cjson.decode(blob)
  policy.records, policy.by_id, policy.by_head, policy.states = {{}, {}, {}, {}}, {{}, {}, {}, {}}, {{}, {}, {}, {}}, {}
  policy.path_text = policy.p[1] .. ' ' .. policy.p[2] .. ' ' .. policy.p[3] .. ' ' .. policy.p[4]
  policy.cells, policy.index, policy.charged, policy.reply = {}, {}, {}, {}   -- check.lua's, refilled per call
  for level = 1, 4 do
    policy.states[level] = {key = false, packed = '', parts = {}, dirty = false, renew = false, min_ttl = 0}
  end
  for _, lim in ipairs(policy.l) do
    lim.kind = lim.m == 'concurrency' and 'c' or kind_of(lim)
    lim.g = lim.w and ceil(lim.w / BUCKETS) or 0
    lim.whole = lim.kind == 'w' and lim.g * BUCKETS == lim.w  -- the ring's 11 buckets all count (check.lua)
    lim.timed = (lim.f or lim.u) and true or false
    lim.charge_text = lim.id .. ',' .. LEVEL_TEXT[lim.lv]
    lim.cell = {lim = lim, st = false, v = false, x = 0, slot = 0, oldest = 0, tokens = 0, start = 0, used = 0,
                remaining = 0, ok = true, retry = 0, reset = 0, newest = false}
    if lim.kind ~= 'c' then
      local rec = policy.by_id[lim.lv][lim.id]
      if not rec then
        rec = {id = lim.id, kind = lim.kind, b = lim.b or 0, present = false, lims = {}, st = policy.states[lim.lv],
               at = 0, loaded = true, patch = false,
               v = lim.kind == 'w' and {-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0} or {0, 0}}
        policy.by_id[lim.lv][lim.id] = rec
        policy.by_head[lim.lv][lim.id .. lim.kind] = rec
        local records = policy.records[lim.lv]
        records[#records + 1] = rec
      end
      rec.lims[#rec.lims + 1] = lim
      lim.rec = rec
    end
  end
  policy_cache[blob], policy_cached = policy, policy_cached + 1
  return policy
end

-- What a window limit still counts at `now`: the buckets oldest..newest, where oldest is the bucket of
-- (now - window). Counting it whole is what makes "never more than the limit in any window-long
-- interval" hold.
local function window_used(c, now)
  local v, lim = c.v, c.lim
  local oldest = (now - lim.w) / lim.g
  oldest = oldest - oldest % 1                                 -- floor, without a C call
  local newest = v[1]
  c.oldest = oldest
  if newest < 0 or oldest > newest then return 0 end
  local used = v[2]
  if newest - BUCKETS >= oldest then return used end  -- no bucket of the ring has left the window
  load_slots(lim.rec)
  for b = newest - BUCKETS, oldest - 1 do used = used - v[slot_index(b)] end  -- left the window
  return used
end

-- Add x (may be negative) to bucket b, advancing the ring and clearing the slots it reuses.
-- Returns whether the ring advanced (the node's TTL must follow).
local function window_add(c, b, x)
  local v, rec = c.v, c.lim.rec
  local newest = v[1]
  if b == newest and x >= 0 and not rec.loaded then    -- the newest bucket, ring not unpacked: patch it
    local k = b % SLOTS
    v[3 + k] = (rec.patch == k and v[3 + k] or sunpack('<d', rec.st.packed, rec.at + 25 + 8 * k)) + x
    v[2] = v[2] + x
    rec.patch = k
    return false
  end
  load_slots(rec)
  rec.patch = false
  if newest >= 0 and b <= newest then
    if b < newest - BUCKETS then b = newest end        -- far behind (a clock step back): count it as newest
    local i = slot_index(b)
    if v[i] + x < 0 then x = -v[i] end                 -- a refund never takes a bucket below zero
    v[i] = v[i] + x
    v[2] = v[2] + x
    return false
  end
  if newest < 0 or b - newest > BUCKETS then
    for i = 3, 2 + SLOTS do v[i] = 0 end
    v[2] = 0
  else
    for k = newest + 1, b do                           -- slot of k held bucket k - SLOTS: drop it
      local i = slot_index(k)
      v[2] = v[2] - v[i]
      v[i] = 0
    end
  end
  x = max(0, x)
  v[slot_index(b)] = x
  v[2] = v[2] + x
  v[1] = b
  return true
end

-- Evaluate a cell for its amount x at `now`: remaining (before x), ok, retry (ms, NEVER, or 0), reset (ms).
local function evaluate(c, now)
  local lim, v, x = c.lim, c.v, c.x
  if lim.b then                                       -- token bucket: capacity b, refill a per w
    local rate = lim.a / lim.w
    local tokens = min(lim.b, v[1] + max(0, now - v[2]) * rate)
    c.tokens = tokens
    c.remaining = floor(tokens)
    c.ok = x <= tokens
    if c.ok then c.retry = 0
    elseif x > lim.b then c.retry = NEVER
    else c.retry = ceil((x - tokens) / rate) end
    c.reset = ceil((lim.b - (c.ok and tokens - x or tokens)) / rate)
  elseif lim.w then                                   -- rolling window, sub-window buckets
    local used, g = window_used(c, now), lim.g
    c.used = used
    c.remaining = lim.a - used
    c.ok = used + x <= lim.a
    if c.ok then c.retry = 0
    elseif x > lim.a then c.retry = NEVER
    else
      -- bucket k stops counting at (k + 1) * g + w: wait until enough of them have
      local need, freed = used + x - lim.a, 0
      c.retry = NEVER
      load_slots(lim.rec)
      for b = max(c.oldest, v[1] - BUCKETS), v[1] do
        freed = freed + v[slot_index(b)]
        if freed >= need then c.retry = max(1, (b + 1) * g + lim.w - now); break end
      end
    end
    local last = used > 0 and v[1] or nil
    if c.ok and x > 0 then last = c.slot end
    local reset = last and (last + 1) * g + lim.w - now or 0
    c.reset = reset > 0 and reset or 0
  else                                                -- calendar period
    local start, finish = period_bounds(lim.p, now)
    local used = v[1] == start and v[2] or 0
    c.start, c.used = start, used
    c.remaining = lim.a - used
    c.ok = used + x <= lim.a
    if c.ok then c.retry = 0 elseif x > lim.a then c.retry = NEVER else c.retry = finish - now end
    c.reset = finish - now
  end
end

-- Charge the cell's x (evaluate() ran at the same `now`) into its node's state.
local function charge(c, now)
  local v, st, renew, lim = c.v, c.st, true, c.lim
  if lim.b then
    v[1], v[2] = c.tokens - c.x, now
    st.min_ttl = max(st.min_ttl, ceil((lim.b - v[1]) * lim.w / lim.a) + 1000)  -- until refilled
  elseif c.lim.w then
    renew = window_add(c, c.slot, c.x)
  else
    renew = c.used == 0
    v[1], v[2] = c.start, c.used + c.x
  end
  lim.rec.present = true
  st.dirty = true
  st.renew = st.renew or renew
end

-- Charge a cell that check.lua evaluated inline (a window charged in its newest bucket): charge()
-- without its tests of the limit's kind; the ring neither advances nor needs a new TTL.
local function charge_newest(c)
  window_add(c, c.slot, c.x)
  c.st.dirty = true
end

-- How long a node's state must live to remember this limit, from `now`.
local function horizon_ms(lim, now)
  if lim.b then return lim.w end
  if lim.w then return lim.w + 2 * ceil(lim.w / BUCKETS) end
  local _, finish = period_bounds(lim.p, now)
  return finish - now
end

-- The TTL of each level's state: the longest horizon of any limit of that level in the policy,
-- whatever tool or model it is narrowed to, so no call cuts another limit's memory short.
local function level_ttls(limits, now)
  local ttl = {0, 0, 0, 0}
  for _, lim in ipairs(limits) do
    if lim.m ~= 'concurrency' then ttl[lim.lv] = max(ttl[lim.lv], horizon_ms(lim, now) + 1000) end
  end
  return ttl
end

-- The TTL a changed state is written with (ms): the longest horizon of its level's limits, and long
-- enough for every token bucket to refill, when a limit moved to a new bucket or period or is a token
-- bucket; else nil (the TTL the key has).
local function state_ttl(policy, level, now)
  local st = policy.states[level]
  if not st.renew then return nil end
  if policy.ttl_at ~= now then policy.ttl, policy.ttl_at = level_ttls(policy.l, now), now end
  return max(policy.ttl[level], st.min_ttl)
end

-- Write a changed state back, with one SET.
local function write_state(policy, level, now)
  local st = policy.states[level]
  store_state(st.key, pack_state(policy, level), st.renew and state_ttl(policy, level, now) or nil)
end

-- Apply a settlement delta (may be negative) to a node's state, where the check made at `checked` (ms)
-- charged it: its bucket (rolling window) or its period (calendar); a token bucket is refilled or drawn now.
local function adjust(st, lim, checked, delta, now)
  local c = new_cell(lim, st, now, 0)
  local v = c.v
  if lim.b then
    evaluate(c, now)                                   -- an extra charge goes into debt
    v[1], v[2] = min(lim.b, c.tokens - delta), now
    st.min_ttl = max(st.min_ttl, ceil((lim.b - v[1]) * lim.w / lim.a) + 1000)
  elseif lim.w then
    window_used(c, now)
    local where = floor(checked / lim.g)
    if v[1] >= 0 and where >= max(c.oldest, v[1] - BUCKETS) and where <= v[1] then
      window_add(c, where, delta)                      -- still counted: correct that bucket
    elseif delta > 0 then
      window_add(c, c.slot, delta)
    end
  else
    local start = period_bounds(lim.p, now)
    local used = v[1] == start and v[2] or 0
    if start == period_bounds(lim.p, checked) or delta > 0 then v[1], v[2] = start, max(0, used + delta) end
  end
  lim.rec.present = true
  st.dirty, st.renew = true, true
end

-- Is this limit in force at `now`? (overrides carry `u`ntil, what they replaced carries `f`rom)
local function active(lim, now)
  return (not lim.f or now >= lim.f) and (not lim.u or now < lim.u)
end

-- Cost in nano-USD of tokens at a price given in nano-USD per 1K tokens, rounded up.
local function cost_nanos(tokens, price_per_1k)
  if tokens <= 0 or price_per_1k <= 0 then return 0 end
  return ceil(tokens * price_per_1k / 1000)
end

-- A usage event, as one stream field (see quotas/engine/usage.py for the order of the values).
-- Every value must already be text or a small integer (no number formatting on the hot path).
local function usage_event(kind, p, tool, model, requests, credits, tokens, input, output, cost, est_tokens,
                           est_cost, now, reservation, unsettled)
  return kind .. '|' .. p[1] .. '|' .. p[2] .. '|' .. p[3] .. '|' .. p[4] .. '|' .. tool .. '|' .. model .. '|'
    .. requests .. '|' .. credits .. '|' .. tokens .. '|' .. input .. '|' .. output .. '|' .. cost .. '|'
    .. est_tokens .. '|' .. est_cost .. '|' .. now .. '|' .. reservation .. '|' .. unsettled
end

-- Reservation records (hash field = id):
--   o|team|user|agent|tool|model|est_tokens|est_cost|checked_ms|charged   open: waiting for its settlement
--   s|tokens|cost|est_tokens|est_cost|settled_ms                            settled (kept to answer repeats)
--   x|est_tokens|est_cost|expired_ms                                        expired unsettled
-- The queue is a list of "pushed_ms:id", pushed as things happen: its entries fall due (pushed + TTL)
-- in the order they are in, without sorting (pushing to a list costs a tenth of adding to a sorted set).

-- Expire what is due among the first `n` entries of the queue: an open reservation counts at its
-- estimate and is reported once as an unsettled usage event; a record past its TTL is deleted.
local function sweep(res_key, queue_key, stream_key, org, now, n, ttl)
  local entries = redis.call('LRANGE', queue_key, 0, n - 1)
  local done, expired = 0, 0
  for _, entry in ipairs(entries) do
    local colon = string.find(entry, ':', 1, true)
    if tonumber(string.sub(entry, 1, colon - 1)) + ttl > now then break end    -- the rest are later
    done = done + 1
    local id = string.sub(entry, colon + 1)
    local rec = redis.call('HGET', res_key, id)
    if rec then
      local f = split(rec, '|')
      if f[1] == 'o' then
        local now_text = int(now)                      -- (not the hot path)
        redis.call('XADD', stream_key, '*', 'e', usage_event('expire', {org, f[2], f[3], f[4]}, f[5], f[6], '0',
          '0', f[7], '0', '0', f[8], f[7], f[8], now_text, id, '1'))
        redis.call('HSET', res_key, id, 'x|' .. f[7] .. '|' .. f[8] .. '|' .. now_text)
        redis.call('RPUSH', queue_key, now_text .. ':' .. id)
        expired = expired + 1
      elseif tonumber(f[#f]) + ttl <= now then
        redis.call('HDEL', res_key, id)                -- settled or expired long enough ago
      end                                              -- (else a later entry of the queue removes it)
    end
  end
  if done > 0 then redis.call('LTRIM', queue_key, done, -1) end
  return expired
end

-- ---- a check, in parts shared by check.lua and check_batch.lua ----

-- A call's weight (credits) and estimated cost (nano-USD, at the higher of the model's two prices),
-- from the org hash's v, t:TOOL and m:MODEL fields.
local function call_cost(org_fields, tokens)
  local weight, cost = tonumber(org_fields[2]) or 1, 0
  if org_fields[3] then
    local price_in, price_out = string.match(org_fields[3], '^(%d+),(%d+)$')
    cost = cost_nanos(tokens, max(tonumber(price_in), tonumber(price_out)))
  end
  return weight, cost
end

-- Evaluate the limits that apply to a call, as cells on their node's state, in the policy's order.
-- states[level] is the level's state, or false: then it is read at the level's first limit, from
-- got[1 + level], the value of keys[2 + level] (check.lua's KEYS layout; keys[9 + level] are the lease
-- zsets, which only a peek reads). Refills the policy's cells[1..n] and index[1..n] (the limit's
-- position in the policy's "l" list) and returns n, blocked (the position among the cells of the
-- blocking limit, 0 for none) and retry (ms until it passes, NEVER, or 0).
local function decide(policy, states, keys, got, peek, tool, model, tokens, weight, cost, now)
  local limits, cells, index = policy.l, policy.cells, policy.index
  local n, blocked, retry = 0, 0, 0
  for i = 1, #limits do
    local lim = limits[i]
    if (not lim.timed or active(lim, now)) and (not lim.t or lim.t == tool) and (not lim.md or lim.md == model) then
      local m = lim.m
      if m ~= 'concurrency' then
        local level = lim.lv
        local st = states[level]
        if not st then st = read_state(policy, level, keys[2 + level], now, got[1 + level]); states[level] = st end
        local x = m == 'tokens' and tokens or m == 'cost' and cost or m == 'credits' and weight or 1
        local c = new_cell(lim, st, now, x)
        n = n + 1
        cells[n], index[n] = c, i
        -- The common case inline: a window whose newest bucket is now's and whose ring lies wholly inside
        -- the window counts its total, and the request fits (evaluate() would find the same; it also finds
        -- when a refused request would pass).
        local v = c.v
        local used = v[2]
        if lim.whole and v[1] == c.slot and used + x <= lim.a then
          c.used, c.remaining, c.ok, c.retry, c.newest = used, lim.a - used, true, 0, true
          c.reset = (used > 0 or x > 0) and (c.slot + 1) * lim.g + lim.w - now or 0
        else
          c.newest = false
          evaluate(c, now)
        end
        if not c.ok and not lim.sh then
          -- the request passes once every blocking limit does: the latest of their retry times
          if blocked == 0 or c.retry == NEVER or (retry ~= NEVER and c.retry > retry) then
            blocked, retry = n, c.retry
          end
        end
      elseif peek then                                 -- leases gate runs, not calls: a check skips them
        local c = lim.cell
        local held = redis.call('ZCOUNT', keys[9 + lim.lv], '(' .. now, '+inf')
        c.x, c.remaining, c.ok, c.retry, c.reset = 1, lim.a - held, held + 1 <= lim.a, 0, 0
        n = n + 1
        cells[n], index[n] = c, i
      end
    end
  end
  return n, blocked, retry
end

-- Charge the n cells decide() evaluated (every limit passed; shadow ones are charged too, so they can
-- report what they would block). Fills the policy's charged[1..m] with the token and cost limits
-- charged ("id,level": settle corrects those, even from an estimate of 0) and returns m.
local function charge_all(policy, n, now)
  local cells, charged, m = policy.cells, policy.charged, 0
  for j = 1, n do
    local c = cells[j]
    if c.newest then charge_newest(c) else charge(c, now) end
    local metric = c.lim.m
    if metric == 'tokens' or metric == 'cost' then
      m = m + 1
      charged[m] = c.lim.charge_text
    end
  end
  return m
end

-- A call's rows of the reply, written from out[k + 1] on: [index * 2 + passed, remaining, reset_ms] per
-- cell (remaining after the charge, when charged). Returns the position of the last value written.
local function put_rows(out, k, policy, n, charged)
  local cells, index = policy.cells, policy.index
  for j = 1, n do
    local c = cells[j]
    out[k + 1] = c.ok and index[j] * 2 + 1 or index[j] * 2
    out[k + 2] = charged and c.remaining - c.x or c.remaining
    out[k + 3] = c.reset
    k = k + 3
  end
  return k
end

-- An admitted call's reservation record (see above), and its usage event; a refused call's event.
local function open_record(p, tool, model, tokens_text, cost_text, now_text, charged, m)
  return 'o|' .. p[2] .. '|' .. p[3] .. '|' .. p[4] .. '|' .. tool .. '|' .. model .. '|' .. tokens_text .. '|'
    .. cost_text .. '|' .. now_text .. '|' .. concat(charged, ';', 1, m)
end

local function check_event(p, tool, model, weight_text, tokens_text, cost_text, now_text, id)
  return usage_event('check', p, tool, model, '1', weight_text, tokens_text, '0', '0', cost_text, '0', '0',
    now_text, id, '0')
end

local function deny_event(p, tool, model, now_text)
  return usage_event('deny', p, tool, model, '0', '0', '0', '0', '0', '0', '0', '0', now_text, '', '0')
end
