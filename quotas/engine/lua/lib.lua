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

-- Counter state of one limit, kept as text in its node's hash (field = limit id).
--   rolling window: "bucket:count;bucket:count;..."  (bucket = floor(t / (window / BUCKETS)))
--   token bucket:   "tokens:last_ms"
--   calendar:       "period_start:count"
local function bucket_ms(lim) return math.ceil(lim.w / BUCKETS) end

local function read_window(state, lim, now)
  -- buckets still counted at `now`: every bucket that may hold an event of (now - window, now]
  local g = bucket_ms(lim)
  local oldest = math.floor((now - lim.w) / g)
  local buckets, used = {}, 0
  if state then
    for b, c in string.gmatch(state, '(%d+):(%d+)') do
      b = tonumber(b); c = tonumber(c)
      if b >= oldest and c > 0 then
        buckets[#buckets + 1] = {b, c}
        used = used + c
      end
    end
  end
  table.sort(buckets, function(x, y) return x[1] < y[1] end)
  return buckets, used
end

local function write_window(buckets)
  local parts = {}
  for i, bc in ipairs(buckets) do parts[i] = int(bc[1]) .. ':' .. int(bc[2]) end
  return table.concat(parts, ';')
end

local function add_to_bucket(buckets, b, x)
  for _, bc in ipairs(buckets) do
    if bc[1] == b then bc[2] = math.max(0, bc[2] + x); return end
  end
  if x > 0 then buckets[#buckets + 1] = {b, x} end
end

-- Evaluate one limit for an amount x at `now`.
-- Returns a table: used, remaining (before x), ok, retry (ms, NEVER, or 0), reset (ms), and
-- what charge() needs to write the new state.
local function evaluate(lim, state, x, now)
  local r = {x = x}
  if lim.b then                                       -- token bucket: capacity b, refill a per w
    local rate = lim.a / lim.w
    local tokens, last = lim.b, now
    if state then
      local t, l = string.match(state, '^([^:]+):(%d+)$')
      if t then tokens, last = tonumber(t), tonumber(l) end
    end
    tokens = math.min(lim.b, tokens + math.max(0, now - last) * rate)
    r.tokens = tokens
    r.used = lim.b - tokens
    r.remaining = math.floor(tokens)
    r.ok = x <= tokens
    if r.ok then r.retry = 0
    elseif x > lim.b then r.retry = NEVER
    else r.retry = math.ceil((x - tokens) / rate) end
    local after = r.ok and tokens - x or tokens
    r.reset = math.ceil((lim.b - after) / rate)
  elseif lim.w then                                   -- rolling window, sub-window buckets
    local buckets, used = read_window(state, lim, now)
    local g = bucket_ms(lim)
    r.buckets = buckets
    r.slot = math.floor(now / g)
    r.used = used
    r.remaining = lim.a - used
    r.ok = used + x <= lim.a
    if r.ok then r.retry = 0
    elseif x > lim.a then r.retry = NEVER
    else
      -- bucket k stops counting at (k + 1) * g + w; wait until enough of them have
      local need, freed = used + x - lim.a, 0
      r.retry = NEVER
      for _, bc in ipairs(buckets) do
        freed = freed + bc[2]
        if freed >= need then r.retry = math.max(1, (bc[1] + 1) * g + lim.w - now); break end
      end
    end
    local last = #buckets > 0 and buckets[#buckets][1] or nil
    if r.ok and x > 0 then last = r.slot end
    r.reset = last and math.max(0, (last + 1) * g + lim.w - now) or 0
  else                                                -- calendar period
    local start, finish = period_bounds(lim.p, now)
    local used = 0
    if state then
      local s, c = string.match(state, '^(%d+):(%d+)$')
      if s and tonumber(s) == start then used = tonumber(c) end
    end
    r.start = start
    r.used = used
    r.remaining = lim.a - used
    r.ok = used + x <= lim.a
    if r.ok then r.retry = 0 elseif x > lim.a then r.retry = NEVER else r.retry = finish - now end
    r.reset = finish - now
  end
  return r
end

-- The new state after charging r.x (evaluate() must have run at the same `now`).
local function charged_state(lim, r, now)
  if lim.b then return string.format('%.17g', r.tokens - r.x) .. ':' .. int(now) end
  if lim.w then
    add_to_bucket(r.buckets, r.slot, r.x)
    return write_window(r.buckets)
  end
  return int(r.start) .. ':' .. int(r.used + r.x)
end

-- How long a node's counter hash must live to remember this limit's state.
local function horizon_ms(lim, now)
  if lim.b then return lim.w end
  if lim.w then return lim.w + bucket_ms(lim) end
  local _, finish = period_bounds(lim.p, now)
  return finish - now
end

-- Apply a settlement delta (may be negative) to a limit's state, where the original
-- charge went: `where` is the bucket (rolling), the period start (calendar) or ignored (bucket).
local function adjust_state(lim, state, where, delta, now)
  if lim.b then
    local r = evaluate(lim, state, 0, now)
    local tokens = math.min(lim.b, r.tokens - delta)    -- a refund refills, an extra charge goes into debt
    return string.format('%.17g', tokens) .. ':' .. int(now)
  end
  if lim.w then
    local buckets = read_window(state, lim, now)
    local present = false
    for _, bc in ipairs(buckets) do if bc[1] == where then present = true end end
    if present then add_to_bucket(buckets, where, delta)
    elseif delta > 0 then add_to_bucket(buckets, math.floor(now / bucket_ms(lim)), delta) end
    return write_window(buckets)
  end
  local start = period_bounds(lim.p, now)
  local used = 0
  if state then
    local s, c = string.match(state, '^(%d+):(%d+)$')
    if s and tonumber(s) == start then used = tonumber(c) end
  end
  if start == where or delta > 0 then used = math.max(0, used + delta) end
  return int(start) .. ':' .. int(used)
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
      redis.call('XADD', stream_key, '*', 'kind', 'expire', 'org', org, 'team', f[2], 'user', f[3], 'agent', f[4],
        'tool', f[5], 'model', f[6], 'tokens', f[7], 'cost_nanos', f[8], 'ts_ms', int(now),
        'reservation', id, 'unsettled', '1')
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
