-- Shared helpers, prepended to every script by quotas/engine/scripts.py.
-- Units: time in integer milliseconds from the server's TIME (or ARGV in tests);
-- cost in integer nano-USD; tokens, requests, credits, leases in whole units.

local BUCKETS = 10            -- a rolling window is counted in this many sub-window buckets
local DAY_MS = 86400000
local NEVER = -1              -- retry_after when the request can never pass (it is larger than the limit)

local function now_ms(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- start and end (ms) of the calendar period holding `now`
local function period_bounds(period, now)
  local days = math.floor(now / DAY_MS)
  if period == 'day' then return days * DAY_MS, (days + 1) * DAY_MS end
  local y, m = civil_from_days(days)
  local ny, nm = y, m + 1
  if nm == 13 then ny, nm = y + 1, 1 end
  return days_from_civil(y, m, 1) * DAY_MS, days_from_civil(ny, nm, 1) * DAY_MS
end

-- Counter state of one limit: numeric fields in its node's hash, named after the limit id.
--   rolling window: ID.L = newest bucket written, ID.T = sum of the ring, ID.0 .. ID.<BUCKETS> = ring of
--                   bucket counts (bucket k = floor(t / (window / BUCKETS)) lives in slot k % (BUCKETS + 1))
--   token bucket:   ID.k = tokens, ID.s = when last refilled (ms)
--   calendar:       ID.P = period start (ms), ID.n = count
-- A check reads two or three fields per limit (one HMGET per level) and writes each level with one
-- HSET; a window limit reads more ring slots only when buckets have just left the window, or to
-- compute retry_after on a refusal.
local SLOTS = BUCKETS + 1

local function bucket_ms(lim) return math.ceil(lim.w / BUCKETS) end

local function slot_field(lim, b) return lim.id .. '.' .. (b % SLOTS) end

-- The fields a check reads: for a window limit, newest bucket, total, and the slot of the bucket
-- of `now` (so that adding to it needs no second read).
local function state_fields(lim, now)
  local id = lim.id
  if lim.b then return {id .. '.k', id .. '.s'} end
  if lim.w then return {id .. '.L', id .. '.T', slot_field(lim, math.floor(now / bucket_ms(lim)))} end
  return {id .. '.P', id .. '.n'}
end

-- The values of the ring slots of buckets first..last (a table bucket -> count).
local function read_slots(key, lim, first, last)
  local counts = {}
  if last < first then return counts end
  local fields = {}
  for b = first, last do fields[#fields + 1] = slot_field(lim, b) end
  local values = redis.call('HMGET', key, unpack(fields))
  for i, b in ipairs(fields) do counts[first + i - 1] = tonumber(values[i]) or 0 end
  return counts
end

-- Window state at `now`: newest bucket, ring total, and what has left the window since it was written.
-- Buckets oldest..newest are counted, where oldest is the bucket of (now - window): counting it whole
-- is what makes "never more than the limit in any window-long interval" hold.
local function window_state(key, lim, v, now)
  local st = {g = bucket_ms(lim), newest = tonumber(v[1]), total = tonumber(v[2]) or 0, current = tonumber(v[3])}
  st.oldest = math.floor((now - lim.w) / st.g)
  st.now = now
  st.used = 0
  if st.newest then
    local stored_from = st.newest - BUCKETS
    if st.oldest > st.newest then
      st.gone = true                                   -- the whole ring has left the window
    else
      st.left = read_slots(key, lim, stored_from, st.oldest - 1)
      st.used = st.total
      for _, c in pairs(st.left) do st.used = st.used - c end
    end
  end
  return st
end

-- Add x to bucket b of a window limit, appending field/value pairs to `out` (advancing the ring
-- and clearing the slots it reuses). Returns whether the ring advanced (the hash's TTL must follow).
local function window_add(key, lim, st, b, x, out)
  local id = lim.id
  if st.newest and not st.gone and b <= st.newest then
    if b < st.newest - BUCKETS then b = st.newest end  -- far behind (a clock step back): count it as newest
    if b == math.floor(st.now / st.g) and st.current then
      out[#out + 1] = slot_field(lim, b); out[#out + 1] = st.current + x
      out[#out + 1] = id .. '.T'; out[#out + 1] = st.total + x
    else                                               -- a slot we did not read: add in place
      redis.call('HINCRBY', key, slot_field(lim, b), x)
      redis.call('HINCRBY', key, id .. '.T', x)
    end
    return false
  end
  local first, total = b - BUCKETS, x
  if st.newest and not st.gone and b - st.newest <= BUCKETS then
    first, total = st.newest + 1, st.total + x
    for k = first, b do total = total - (st.left[k - SLOTS] or 0) end  -- slot of k held bucket k - SLOTS
  end
  for k = first, b - 1 do out[#out + 1] = slot_field(lim, k); out[#out + 1] = 0 end
  out[#out + 1] = slot_field(lim, b); out[#out + 1] = x
  out[#out + 1] = id .. '.T'; out[#out + 1] = total
  out[#out + 1] = id .. '.L'; out[#out + 1] = b
  return true
end

-- Evaluate one limit for an amount x at `now`; v are the values of state_fields(lim) in hash `key`.
-- Returns: remaining (before x), ok, retry (ms, NEVER, or 0), reset (ms), plus what charge() needs.
local function evaluate(key, lim, v, x, now)
  local r = {x = x}
  if lim.b then                                       -- token bucket: capacity b, refill a per w
    local rate = lim.a / lim.w
    local tokens, last = tonumber(v[1]), tonumber(v[2])
    if not tokens then tokens, last = lim.b, now end
    tokens = math.min(lim.b, tokens + math.max(0, now - last) * rate)
    r.tokens = tokens
    r.remaining = math.floor(tokens)
    r.ok = x <= tokens
    if r.ok then r.retry = 0
    elseif x > lim.b then r.retry = NEVER
    else r.retry = math.ceil((x - tokens) / rate) end
    local after = r.ok and tokens - x or tokens
    r.reset = math.ceil((lim.b - after) / rate)
  elseif lim.w then                                   -- rolling window, sub-window buckets
    local st = window_state(key, lim, v, now)
    r.st = st
    r.remaining = lim.a - st.used
    r.ok = st.used + x <= lim.a
    if r.ok then r.retry = 0
    elseif x > lim.a then r.retry = NEVER
    else
      -- bucket k stops counting at (k + 1) * g + w: wait until enough of them have
      local first = math.max(st.oldest, st.newest - BUCKETS)
      local counts = read_slots(key, lim, first, st.newest)
      local need, freed = st.used + x - lim.a, 0
      r.retry = NEVER
      for b = first, st.newest do
        freed = freed + counts[b]
        if freed >= need then r.retry = math.max(1, (b + 1) * st.g + lim.w - now); break end
      end
    end
    local last = st.used > 0 and st.newest or nil
    if r.ok and x > 0 then last = math.floor(now / st.g) end
    r.reset = last and math.max(0, (last + 1) * st.g + lim.w - now) or 0
  else                                                -- calendar period
    local start, finish = period_bounds(lim.p, now)
    local used = 0
    if tonumber(v[1]) == start then used = tonumber(v[2]) or 0 end
    r.start, r.used = start, used
    r.remaining = lim.a - used
    r.ok = used + x <= lim.a
    if r.ok then r.retry = 0 elseif x > lim.a then r.retry = NEVER else r.retry = finish - now end
    r.reset = finish - now
  end
  return r
end

-- Charge r.x (evaluate() ran at the same `now`), appending field/value pairs to `out`.
-- Returns where the charge went, for a later settlement (the bucket, the period start, or 0 for a
-- token bucket), and whether the hash's TTL must be renewed.
local function charge(key, lim, r, now, out)
  local id = lim.id
  if lim.b then
    out[#out + 1] = id .. '.k'; out[#out + 1] = r.tokens - r.x
    out[#out + 1] = id .. '.s'; out[#out + 1] = now
    return 0, true
  end
  if lim.w then
    local b = math.floor(now / r.st.g)
    return b, window_add(key, lim, r.st, b, r.x, out)
  end
  out[#out + 1] = id .. '.P'; out[#out + 1] = r.start
  out[#out + 1] = id .. '.n'; out[#out + 1] = r.used + r.x
  return r.start, r.used == 0
end

-- How long a node's counter hash must live to remember this limit's state, from `now`.
local function horizon_ms(lim, now)
  if lim.b then return lim.w end
  if lim.w then return lim.w + 2 * bucket_ms(lim) end
  local _, finish = period_bounds(lim.p, now)
  return finish - now
end

-- The TTL of each level's counter hash: the longest horizon of any limit of that level in the
-- policy, whatever tool or model it is narrowed to, so no call cuts another limit's memory short.
local function level_ttls(limits, now)
  local ttl = {0, 0, 0, 0}
  for _, lim in ipairs(limits) do
    if lim.m ~= 'concurrency' then ttl[lim.lv] = math.max(ttl[lim.lv], horizon_ms(lim, now) + 1000) end
  end
  return ttl
end

-- Apply a settlement delta (may be negative) where the original charge went
-- (`where`: bucket, period start, ignored for token buckets).
local function adjust(key, lim, where, delta, now)
  local id = lim.id
  local v = redis.call('HMGET', key, unpack(state_fields(lim, now)))
  local out = {}
  if lim.b then
    local r = evaluate(key, lim, v, 0, now)              -- an extra charge goes into debt
    out = {id .. '.k', math.min(lim.b, r.tokens - delta), id .. '.s', now}
  elseif lim.w then
    local st = window_state(key, lim, v, now)
    if st.newest and not st.gone and where >= math.max(st.oldest, st.newest - BUCKETS) and where <= st.newest then
      window_add(key, lim, st, where, delta, out)        -- still counted: correct that bucket
    elseif delta > 0 then
      window_add(key, lim, st, math.floor(now / st.g), delta, out)
    end
  else
    local start = period_bounds(lim.p, now)
    local used = tonumber(v[1]) == start and (tonumber(v[2]) or 0) or 0
    if start == where or delta > 0 then out = {id .. '.P', start, id .. '.n', math.max(0, used + delta)} end
  end
  if #out > 0 then redis.call('HSET', key, unpack(out)) end
end

-- Is this limit in force at `now`? (overrides carry `u`ntil, what they replaced carries `f`rom)
local function active(lim, now)
  return (not lim.f or now >= lim.f) and (not lim.u or now < lim.u)
end

-- Cost in nano-USD of tokens at a price given in nano-USD per 1K tokens, rounded up.
local function cost_nanos(tokens, price_per_1k)
  if tokens <= 0 or price_per_1k <= 0 then return 0 end
  return math.ceil(tokens * price_per_1k / 1000)
end

-- A usage event, as one stream field (see quotas/engine/usage.py for the order of the values).
local function usage_event(kind, p, tool, model, requests, credits, tokens, input, output, cost, est_tokens,
                           est_cost, now, reservation, unsettled)
  return kind .. '|' .. p[1] .. '|' .. p[2] .. '|' .. p[3] .. '|' .. p[4] .. '|' .. tool .. '|' .. model .. '|'
    .. requests .. '|' .. credits .. '|' .. int(tokens) .. '|' .. int(input) .. '|' .. int(output) .. '|'
    .. int(cost) .. '|' .. int(est_tokens) .. '|' .. int(est_cost) .. '|' .. int(now) .. '|' .. reservation
    .. '|' .. unsettled
end

-- Expire up to `n` reservations whose time is up: each counts at its estimate and is
-- reported as an unsettled usage event; a record past its retention is deleted.
-- res_key: hash id -> record, open_key: zset id -> deadline, stream_key: usage stream.
local function sweep(res_key, open_key, stream_key, org, now, n, retention)
  local due = redis.call('ZRANGEBYSCORE', open_key, '-inf', now, 'LIMIT', 0, n)
  local expired = 0
  for _, id in ipairs(due) do
    local rec = redis.call('HGET', res_key, id)
    if rec and string.sub(rec, 1, 2) == 'o|' then
      local f = split(rec, '|')
      -- o|team|user|agent|tool|model|est_tokens|est_cost|created|charges
      redis.call('XADD', stream_key, '*', 'e', usage_event('expire', {org, f[2], f[3], f[4]}, f[5], f[6], 0, 0,
        f[7], 0, 0, f[8], f[7], f[8], now, id, 1))
      redis.call('HSET', res_key, id, 'x|' .. f[7] .. '|' .. f[8])
      redis.call('ZADD', open_key, now + retention, id)
      expired = expired + 1
    else
      redis.call('HDEL', res_key, id)
      redis.call('ZREM', open_key, id)
    end
  end
  return expired
end
